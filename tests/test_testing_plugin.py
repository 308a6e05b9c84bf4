"""The pytest plugin for users, run as users run it: pytest in a subprocess on their test files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import asyncpg
import pytest

import aioq
import aioq.testing
from aioq.testing import plugin

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.anyio


def run_pytest(
    directory: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, str(directory)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.timeout(300)
def test_the_guides_examples_pass_together_on_an_embedded_server_in_a_fresh_pytest() -> None:
    # As a user runs it: nothing set but the plugin, installed through its entry point. The
    # folder mixes plain `def` tests, async tests, an async fixture of the app's and an HTTP
    # client: they must run together.
    env = {k: v for k, v in os.environ.items() if k not in ("AIOQ_TEST_DSN", "AIOQ_DSN")}
    result = run_pytest(ROOT / "examples" / "testing", "-W", "error", "-rA", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 passed" in result.stdout
    assert "PASSED test_units.py::test_a_thumbnail_is_named_after_its_job" in result.stdout
    # The testing guide quotes these very files (tests/test_docs.py checks the quotes match).
    guide = (ROOT / "docs" / "testing.md").read_text()
    for name in ("conftest.py", "test_shop.py", "test_units.py", "test_api.py"):
        assert f"<!-- quote: examples/testing/{name} -->" in guide


USER_TESTS = """
import anyio
import pytest

import aioq
import aioq.testing

pytestmark = pytest.mark.anyio
runs = []
conns = []  # the test's connection, for the task that defers another


@aioq.task(queue="q1")
async def first(n: int) -> None:
    runs.append(("first", n))
    await second.defer(conns[-1], n=n + 1)


@aioq.task(queue="q2")
async def second(n: int) -> None:
    runs.append(("second", n))


@aioq.task(max_attempts=1)
async def broken() -> None:
    raise ValueError("broken on purpose")


@aioq.task
async def sleepy() -> None:
    if aioq.current_job().attempt == 1 and "snoozed" not in runs:
        runs.append("snoozed")
        raise aioq.Retry(0)


@aioq.task
async def forever() -> None:
    raise aioq.Retry(0)


@pytest.fixture
async def conn_for_tasks(aioq_conn):
    conns.append(aioq_conn)


def test_sync_tests_get_a_dsn_with_the_schema(aioq_dsn):
    assert aioq_dsn.startswith("postgresql://")


async def test_a_defers(aioq_conn):
    await first.defer(aioq_conn, n=1)
    assert [job.args for job in await aioq.testing.deferred(aioq_conn, first)] == [{"n": 1}]


async def test_b_starts_from_a_fresh_schema(aioq_conn):
    assert await aioq.testing.deferred(aioq_conn, first) == []
    assert await aioq.admin.list_jobs(aioq_conn) == []


async def test_drain_follows_jobs_into_other_queues(aioq_conn, aioq_drain, conn_for_tasks):
    await first.defer(aioq_conn, n=1)
    ran = await aioq_drain()
    assert [(r.task, r.queue, r.args, r.outcome) for r in ran] == [
        (first.name, "q1", {"n": 1}, "succeeded"),
        (second.name, "q2", {"n": 2}, "succeeded"),
    ]
    assert ("second", 2) in runs
    assert await aioq_drain() == []  # nothing left


async def test_drain_reports_dead_and_snoozed(aioq_conn, aioq_drain):
    await broken.defer(aioq_conn)
    await sleepy.defer(aioq_conn)
    ran = await aioq_drain(aioq.registry.default_registry)
    outcomes = sorted((r.task.rsplit(".", 1)[1], r.outcome) for r in ran)
    assert outcomes == [("broken", "dead"), ("sleepy", "snoozed"), ("sleepy", "succeeded")]
    dead = next(r for r in ran if r.outcome == "dead")
    assert dead.error.startswith("ValueError: broken on purpose")
    assert not dead.succeeded


async def test_a_task_that_never_finishes_stops_the_drain(aioq_conn, aioq_drain):
    await forever.defer(aioq_conn)
    with pytest.raises(aioq.testing.DrainError, match="max_runs=5"):
        await aioq_drain(max_runs=5)


async def test_the_worker_fixture_runs_jobs(aioq_conn, aioq_worker, conn_for_tasks):
    await first.defer(aioq_conn, n=10)
    with anyio.fail_after(30):
        while ("second", 11) not in runs:
            await anyio.sleep(0.02)
    assert aioq_worker.registry is aioq.registry.default_registry
"""


@pytest.mark.timeout(300)
def test_user_tests_against_aioq_test_dsn(admin_dsn: str, tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\nxfail_strict = true\n")
    env = {**os.environ, "AIOQ_TEST_DSN": admin_dsn}
    before = anyio.run(databases, admin_dsn)
    result = run_pytest(tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 passed" in result.stdout
    assert anyio.run(databases, admin_dsn) == before  # the session's database was dropped


WRONG_REGISTRY_TESTS = """
import anyio
import pytest

import aioq

pytestmark = pytest.mark.anyio

app = aioq.Registry()  # the app's tasks, and no aioq_registry fixture returning it


@app.task(name="app.mail", queue="mail")
async def mail() -> None: ...


@app.task(name="app.note")
async def note() -> None: ...


async def test_jobs_on_a_registry_the_worker_does_not_serve(aioq_conn, aioq_worker):
    await mail.defer(aioq_conn)
    await note.defer(aioq_conn)
    await anyio.sleep(0.5)  # the worker claims the note and fails it: it has no such task


async def test_jobs_in_a_queue_the_worker_does_not_serve(aioq_conn, aioq_registry, aioq_worker):
    @aioq_registry.task(name="app.report")
    async def report() -> None: ...

    await report.options(queue="reports").defer(aioq_conn)
"""


@pytest.mark.timeout(300)
def test_the_worker_fixture_says_which_registry_or_queue_left_jobs_waiting(
    admin_dsn: str, tmp_path: Path
) -> None:
    (tmp_path / "test_user.py").write_text(WRONG_REGISTRY_TESTS)
    result = run_pytest(tmp_path, "-rA", env={**os.environ, "AIOQ_TEST_DSN": admin_dsn})
    assert result.returncode == 0, result.stdout + result.stderr
    out = " ".join(result.stdout.split())  # the summary wraps long warnings
    assert "2 passed" in out
    assert "aioq_worker's registry has no task: its worker runs nothing" in out
    assert "aioq_worker's registry (0 tasks) has no task app.mail, app.note, whose jobs it" in out
    assert "return your app's registry from an aioq_registry fixture in conftest.py" in out
    assert "aioq_worker served the queues default (its registry's tasks' own) and left" in out
    assert "jobs waiting in reports" in out  # the second test: a queue by options(queue=...)


async def databases(dsn: str) -> set[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return {row[0] for row in await conn.fetch("SELECT datname FROM pg_database")}
    finally:
        await conn.close()


def test_every_plugin_fixture_is_prefixed_so_it_cannot_shadow_a_projects_own() -> None:
    fixtures = [
        name
        for name, value in vars(plugin).items()
        if type(value).__name__ == "FixtureFunctionDefinition"
    ]
    assert sorted(fixtures) == sorted(plugin.__all__)
    assert all(name.startswith("aioq_") for name in fixtures)


async def test_deferred_lists_waiting_jobs_with_arguments_on_any_target(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(queue="mail")
    async def mail(to: str, tags: list[str]) -> None:
        pass

    @registry.task
    async def other() -> None:
        pass

    now = await mail.defer(conn, to="a@x", tags=["welcome"])
    later = await mail.options(delay=3600, priority=2, unique_key="mail:b").defer(
        conn, to="b@x", tags=[]
    )
    await other.defer(conn)
    waiting = await aioq.testing.deferred(conn, mail)
    assert [(w.id, w.args, w.priority, w.queue, w.unique_key) for w in waiting] == [
        (now, {"to": "a@x", "tags": ["welcome"]}, 0, "mail", None),
        (later, {"to": "b@x", "tags": []}, 2, "mail", "mail:b"),
    ]
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
        assert await aioq.testing.deferred(pool, mail) == waiting


async def test_drain_runs_each_ready_job_once_and_leaves_scheduled_ones(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    seen: list[int] = []

    @registry.task(queue="a")
    async def count(n: int) -> None:
        seen.append(n)

    ids = await count.defer_many(conn, [{"n": n} for n in range(20)])
    scheduled = await count.options(delay=3600).defer(conn, n=99)
    ran = await aioq.testing.drain(dsn, registry, concurrency=4)
    assert sorted(r.id for r in ran) == ids
    assert sorted(seen) == list(range(20))
    assert {r.outcome for r in ran} == {"succeeded"}
    assert [w.id for w in await aioq.testing.deferred(conn, count)] == [scheduled]


async def test_a_drain_on_a_registry_without_the_task_says_which_fixture_to_override(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, caplog: pytest.LogCaptureFixture
) -> None:
    @registry.task(name="app.welcome")
    async def welcome() -> None:
        pass

    await welcome.defer(conn)
    [ran] = await aioq.testing.drain(dsn, aioq.Registry(), concurrency=1)  # not the app's
    # The drain's registry is the fleet: no worker that knows the task will come. Dead at once.
    assert (ran.task, ran.outcome) == ("app.welcome", "dead")
    [warning] = [r.getMessage() for r in caplog.records if r.name == "aioq.testing.helpers"]
    assert "the drain's registry (0 tasks) has no task app.welcome" in warning
    assert "an aioq_registry fixture in conftest.py" in warning
    caplog.clear()
    assert await aioq.testing.drain(dsn, registry) == []  # it is dead: nothing ran
    assert [r for r in caplog.records if r.name == "aioq.testing.helpers"] == []
