"""Workflows: steps with dependencies (docs/architecture.md, "Workflows")."""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import subprocess
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import asyncpg
import psycopg
import pytest
import statements
from procs import aioq_cli
from starlette.testclient import TestClient
from waits import eventually, until_sql

import aioq
import aioq.testing
import aioq.web
from aioq.job import OutcomeKind
from aioq.sql import workflows as wsql
from aioq.worker.maintenance import Pruner

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def three_workers(
    make_worker: Callable[..., aioq.Worker], **options: Any
) -> AsyncIterator[anyio.CancelScope]:
    """Three workers running in this process while the block runs. The first runs inside the
    scope yielded: its cancel() is a hard cancel of that worker mid-flight, claims and all. The
    other two are stopped when the block ends."""
    workers = [make_worker(**options) for _ in range(3)]
    doomed = anyio.CancelScope()

    async def hard_cancelled() -> None:
        with doomed:
            await workers[0].run()

    async with anyio.create_task_group() as tg:
        tg.start_soon(hard_cancelled)
        for worker in workers[1:]:
            tg.start_soon(worker.run)
        yield doomed
        for worker in workers[1:]:
            worker.stop()


async def statuses(conn: asyncpg.Connection, run_id: int) -> dict[str, str]:
    info = await aioq.workflow(conn, run_id)
    assert info is not None
    return {s.name: s.status for s in info.steps}


async def test_fan_out_fan_in_runs_once_with_upstream_results(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    seen: list[dict[str, Any]] = []

    @registry.task
    async def extract(day: str) -> str:
        return f"raw-{day}"

    @registry.task
    async def transform(part: int) -> int:
        up = await aioq.current_job().upstream()
        assert up == {"extract": "raw-d1"}
        return part * 10

    @registry.task
    async def load() -> None:
        seen.append(await aioq.current_job().upstream())

    flow = aioq.Workflow("nightly")
    raw = flow.add(extract.call(day="d1"))
    parts = [flow.add(transform.call(part=i), after=[raw]) for i in range(20)]
    flow.add(load.call(), after=parts, name="load")
    async with conn.transaction():
        run = await flow.defer(conn)
    assert set(run.jobs) == {
        "extract",
        "load",
        "transform",
        *(f"transform-{i}" for i in range(2, 21)),
    }
    before = await statuses(conn, run.id)
    assert before["extract"] == "pending"
    assert before["load"] == "waiting"
    assert before["transform-5"] == "waiting"
    job = await aioq.admin.get_job(conn, run.jobs["load"])
    assert job is not None
    assert job.status == aioq.admin.JobStatus.WAITING

    await make_worker(concurrency=8).run_until_idle()
    assert len(seen) == 1
    expected = {"transform": 0, **{f"transform-{i}": (i - 1) * 10 for i in range(2, 21)}}
    assert seen[0] == expected
    info = await aioq.workflow(conn, run.id)
    assert info is not None
    assert info.state == "succeeded"
    assert {s.status for s in info.steps} == {"succeeded"}
    assert info.counts["succeeded"] == 22
    by_name = {s.name: s for s in info.steps}
    assert by_name["load"].after == ["transform", *(f"transform-{i}" for i in range(2, 21))]
    assert by_name["transform-3"].result == 20


async def test_rolled_back_transaction_leaves_no_step(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def step(n: int) -> None:
        pass

    flow = aioq.chain(*(step.call(n=i) for i in range(8_002)))  # once two batches and more
    tx = conn.transaction()
    await tx.start()
    run = await flow.defer(conn)
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 8_002
    assert conn.is_in_transaction()  # the caller's, never committed by the defer
    await tx.rollback()
    for table in ("jobs", "workflows", "workflow_steps", "workflow_deps"):
        assert await conn.fetchval(f"SELECT count(*) FROM aioq.{table}") == 0
    assert await aioq.workflow(conn, run.id) is None


async def test_dead_step_cancels_dependents_and_replay_resumes(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    broken = {"yes": True}
    ran: list[str] = []

    @registry.task(max_attempts=1)
    async def fragile() -> str:
        if broken["yes"]:
            raise RuntimeError("boom")
        return "ok"

    @registry.task
    async def after(label: str) -> str:
        ran.append(label)
        return label

    @registry.task
    async def report() -> None:
        up = await aioq.current_job().upstream()
        ran.append(f"report:{sorted(up)}:{type(up['fragile']).__name__}")

    flow = aioq.Workflow("w")
    bad = flow.add(fragile.call())
    mid = flow.add(after.call(label="mid"), after=[bad])
    flow.add(after.call(label="end"), after=[mid], name="end")
    flow.add(report.call(), after=[bad], on_failure="run")
    run = await flow.defer(conn)
    await make_worker().run_until_idle()

    now = await statuses(conn, run.id)
    assert now == {
        "fragile": "dead",
        "after": "cancelled",
        "end": "cancelled",
        "report": "succeeded",
    }
    assert ran == ["report:['fragile']:StepFailed"]
    for name in ("after", "end"):
        job = await aioq.admin.get_job(conn, run.jobs[name])
        assert job is not None
        assert job.last_error is not None
        assert "'fragile'" in job.last_error, job.last_error
    info = await aioq.workflow(conn, run.id)
    assert info is not None
    assert info.state == "failed"

    broken["yes"] = False
    replay = await aioq.admin.replay(conn, job_id=run.jobs["fragile"])
    assert replay.replayed == [run.jobs["fragile"]]
    assert replay.revived == {run.jobs["after"]: "after", run.jobs["end"]: "end"}
    now = await statuses(conn, run.id)
    assert now["after"] == "waiting"
    assert now["end"] == "waiting"
    await make_worker().run_until_idle()
    assert await statuses(conn, run.id) == dict.fromkeys(now, "succeeded")
    assert ran[1:] == ["mid", "end"]


async def test_a_failed_run_stays_failed_once_its_dead_step_is_purged(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task(max_attempts=1)
    async def fragile(n: int) -> int:
        if n == 0:
            raise RuntimeError("boom")
        return n

    run = await aioq.group(fragile.call(n=0), fragile.call(n=1)).defer(conn)
    await make_worker().run_until_idle()
    info = await aioq.workflow(conn, run.id)
    assert info is not None
    assert info.state == "failed"
    assert (
        await aioq.admin.purge_dead(conn) == 1
    )  # what `aioq jobs purge --dead` and dead_retention do
    info = await aioq.workflow(conn, run.id)
    assert info is not None
    assert {s.name: s.status for s in info.steps} == {
        "fragile": "deleted",
        "fragile-2": "succeeded",
    }
    assert info.state == "failed"  # not "succeeded": one step never did
    [listed] = await aioq.admin.list_workflows(conn)
    assert listed.state == "failed"


async def test_cancel_workflow(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task
    async def step(n: int) -> None:
        pass

    run = await aioq.group(*(step.call(n=i) for i in range(3)), then=step.call(n=9)).defer(conn)
    assert await aioq.admin.delete_jobs(conn, list(run.jobs.values())) == []  # cancel them instead
    states = await aioq.admin.cancel_workflow(conn, run.id)
    assert set(states.values()) == {"cancelled"}
    await make_worker().run_until_idle()
    assert set((await statuses(conn, run.id)).values()) == {"cancelled"}
    info = await aioq.workflow(conn, run.id)
    assert info is not None
    assert info.state == "cancelled"


async def test_ids_no_run_can_have_name_nothing(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    """A run id outside bigint names no run (as get_job answers for job ids): the lookups say
    so without asking the database, from Python and from a shell."""

    @registry.task(name="app.step")
    async def step(n: int) -> None:
        pass

    run = await aioq.chain(step.call(n=1), step.call(n=2)).defer(conn)
    sync = psycopg.connect(dsn, autocommit=True)
    for absent in (2**63, 2**64 + 5, -(2**63) - 1, 10**20):
        assert await aioq.workflow(conn, absent) is None
        assert await aioq.admin.cancel_workflow(conn, absent) == {}
        assert aioq.workflow_sync(sync, absent) is None
        assert aioq.admin.cancel_workflow_sync(sync, absent) == {}
        for verb in ("show", "cancel"):
            found = aioq_cli(dsn, "workflows", verb, str(absent))
            assert found.returncode == 1, found
            assert found.stderr == f"aioq: workflow {absent} not found (pruned, or never existed)\n"
    sync.close()
    # The run itself was left alone.
    assert set((await statuses(conn, run.id)).values()) == {"pending", "waiting"}


def test_build_errors(registry: aioq.Registry) -> None:
    @registry.task
    async def step(n: int) -> None:
        pass

    flow, other = aioq.Workflow("a"), aioq.Workflow("b")
    s = other.add(step.call(n=1))
    with pytest.raises(aioq.errors.ConfigError, match=r"belongs to another workflow \('b'\)"):
        flow.add(step.call(n=1), after=[s])
    twin = aioq.chain(step.call(n=1))  # two chains share a name: the message still tells them apart
    with pytest.raises(aioq.errors.ConfigError, match=r"another workflow .* this workflow's add"):
        twin.add(step.call(n=2), after=[aioq.chain(step.call(n=3)).add(step.call(n=4))])
    flow.add(step.call(n=1), name="x")
    with pytest.raises(aioq.errors.ConfigError, match="already used"):
        flow.add(step.call(n=2), name="x")
    with pytest.raises(aioq.ArgumentError):
        step.call(m=1)  # type: ignore[call-arg]
    with pytest.raises(aioq.errors.OptionError):
        step.options(unique_key="k").call(n=1)
    with pytest.raises(aioq.errors.ConfigError, match="on_failure"):
        flow.add(step.call(n=1), on_failure="ignore")


async def test_a_large_run_is_written_by_one_statement(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def part(n: int) -> None:
        pass

    flow = aioq.Workflow("big")
    first = flow.add(part.call(n=-1))
    parts = [flow.add(part.call(n=i), after=[first]) for i in range(9_000)]
    flow.add(part.call(n=-2), after=parts, name="merge")
    statements: list[str] = []
    conn.add_query_logger(lambda q: statements.append(q.query))
    async with conn.transaction():
        run = await flow.defer(conn)
    # The steps' ids, then the run and every step in one statement (asyncpg's own type
    # introspection and the transaction's aside).
    ours = [q for q in statements if '"aioq".' in q]
    assert len(ours) == 2, ours
    assert len(run.jobs) == 9_002
    assert await conn.fetchval("SELECT count(*) FROM aioq.workflow_deps") == 18_000
    assert (
        await conn.fetchval(
            "SELECT remaining FROM aioq.workflow_steps WHERE job_id = $1", run.jobs["merge"]
        )
        == 9_000
    )


async def test_pruned_after_retention(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task
    async def step(n: int) -> int:
        return n

    run = await aioq.chain(step.call(n=1), step.call(n=2)).defer(conn)
    await make_worker().run_until_idle()
    assert await wsql.PRUNE_WORKFLOWS.row(conn, "aioq", 3600.0, 100) == 0
    assert await wsql.PRUNE_WORKFLOWS.row(conn, "aioq", 0.0, 100) == 1
    assert await aioq.workflow(conn, run.id) is None
    assert await conn.fetchval("SELECT count(*) FROM aioq.workflow_steps") == 0
    await eventually(lambda: True)


async def test_pruner_keeps_runs_for_the_workflow_retention(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """The pruner deletes a finished run after the worker's workflow_retention (None: never)."""

    @registry.task
    async def step(n: int) -> int:
        return n

    run = await aioq.chain(step.call(n=1), step.call(n=2)).defer(conn)
    await make_worker().run_until_idle()
    await conn.execute(
        "UPDATE aioq.workflows SET created_at = now() - interval '2 hours' WHERE id = $1", run.id
    )

    def pruner(retention: float | None) -> Pruner:
        return Pruner(
            schema="aioq",
            db=conn,
            archive_retention=None,
            dead_retention=None,
            workflow_retention=retention,
            interval=3600,
            batch_size=10,
        )

    assert await pruner(None).run_once() == 0  # kept for ever
    assert await pruner(3 * 3600).run_once() == 0  # younger than the retention
    assert await aioq.workflow(conn, run.id) is not None
    assert await pruner(3600).run_once() == 1
    assert await aioq.workflow(conn, run.id) is None
    assert aioq.WorkerConfig().workflow_retention == 86400
    assert make_worker(workflow_retention=600).config.workflow_retention == 600


async def test_fan_in_waits_for_its_last_parent(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    """One parent's success is recorded while the other still runs: the fan-in still waits
    (the statement that recorded the first success left it waiting), and runs after both."""
    ids: dict[str, int] = {}
    seen: list[str] = []

    @registry.task
    async def first() -> int:
        return 1

    @registry.task
    async def second() -> int:
        check = await asyncpg.connect(dsn)
        try:
            await eventually(
                lambda: check.fetchval(
                    "SELECT succeeded_at IS NOT NULL FROM aioq.workflow_steps WHERE job_id = $1",
                    ids["first"],
                ),
                "the first parent's success",
            )
            seen.append(
                await check.fetchval("SELECT status FROM aioq.jobs WHERE id = $1", ids["join"])
            )
        finally:
            await check.close()
        return 2

    @registry.task
    async def join() -> None:
        seen.append(repr(await aioq.current_job().upstream()))

    run = await aioq.group(first.call(), second.call(), then=join.call()).defer(conn)
    ids.update(run.jobs)
    await make_worker(concurrency=4).run_until_idle()
    assert seen == ["waiting", "{'first': 1, 'second': 2}"]


async def test_cli_lists_shows_and_cancels_runs(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(name="app.step")
    async def step(n: int) -> None:
        pass

    run = await aioq.group(
        step.call(n=1), step.call(n=2), then=step.call(n=3), name="nightly"
    ).defer(conn)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return aioq_cli(dsn, *args)

    listed = cli("workflows", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["id"], row["name"], row["state"]) == (run.id, "nightly", "running")
    assert row["counts"] == {
        "waiting": 1, "pending": 2, "running": 0, "succeeded": 0, "dead": 0, "cancelled": 0
    }  # fmt: skip
    table = cli("workflows", "list")
    assert "nightly" in table.stdout
    assert "WAITING" in table.stdout
    shown = cli("workflows", "show", str(run.id))
    assert shown.returncode == 0, shown.stderr
    assert f"workflow {run.id} nightly: running (1 waiting, 2 pending)" in shown.stdout
    assert any(
        line.split()[:5]
        == ["step-3", str(run.jobs["step-3"]), "app.step", "waiting", "step,step-2"]
        for line in shown.stdout.splitlines()
    ), shown.stdout
    waiting = cli("jobs", "list", "--status", "waiting", "--json")
    assert [j["id"] for j in json.loads(waiting.stdout)] == [run.jobs["step-3"]]
    job = cli("jobs", "show", str(run.jobs["step-3"]))
    shown_job = dict(line.split(maxsplit=1) for line in job.stdout.splitlines())
    assert (shown_job["status:"], shown_job["workflow_id:"]) == ("waiting", str(run.id))
    cancelled = cli("workflows", "cancel", str(run.id))
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"workflow {run.id}: cancelled 3 steps" in cancelled.stdout
    again = cli("workflows", "show", str(run.id), "--json")
    assert json.loads(again.stdout)["state"] == "cancelled"
    twice = cli("workflows", "cancel", str(run.id))
    assert twice.returncode == 0, twice.stderr
    assert (
        twice.stdout
        == f"workflow {run.id}: nothing left to cancel, every step ended (run cancelled)\n"
    )
    missing = cli("workflows", "show", "999")
    assert missing.returncode == 1
    assert "workflow 999 not found" in missing.stderr


async def test_cli_shortens_a_fan_in_and_says_which_step_to_replay(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    @registry.task(name="app.part", max_attempts=1)
    async def part(n: int) -> None:
        if n == 0:
            raise RuntimeError("boom")

    @registry.task(name="app.merge")
    async def merge() -> None:
        pass

    run = await aioq.group(*(part.call(n=i) for i in range(6)), then=merge.call()).defer(conn)
    await make_worker().run_until_idle()
    shown = aioq_cli(dsn, "workflows", "show", str(run.id))
    assert shown.returncode == 0, shown.stderr
    [row] = [line for line in shown.stdout.splitlines() if line.startswith("merge ")]
    assert "part,part-2,part-3 +3 more" in row, shown.stdout
    assert max(map(len, shown.stdout.splitlines())) < 150, shown.stdout  # not 6 names wide
    # A new user's first try: replay the step that was cancelled, not the one that died.
    replayed = aioq_cli(dsn, "jobs", "replay", str(run.jobs["merge"]))
    assert replayed.returncode == 1
    assert (
        f"skipped job {run.jobs['merge']}: cancelled because step 'part' (job"
        f" {run.jobs['part']}), which it needs, ended dead: replay job {run.jobs['part']}"
        " instead, and the steps it cancelled wait again"
    ) in replayed.stdout, replayed.stdout
    assert (await statuses(conn, run.id))["merge"] == "cancelled"
    stopped = await aioq.chain(part.call(n=1), merge.call()).defer(conn)
    await aioq.admin.cancel_jobs(conn, [stopped.jobs["part"]])
    replayed = aioq_cli(dsn, "jobs", "replay", str(stopped.jobs["merge"]))
    assert replayed.returncode == 1
    assert "which it needs, was cancelled: a cancelled job is not replayed" in replayed.stdout, (
        replayed.stdout
    )
    # The step that died: its dependent waits again, and the replay says so.
    replayed = aioq_cli(dsn, "jobs", "replay", str(run.jobs["part"]))
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout == (
        f"replayed 1 job: {run.jobs['part']}\n"
        f"revived 1 dependent step, waiting again: {run.jobs['merge']} (merge)\n"
    )
    assert (await statuses(conn, run.id))["merge"] == "waiting"
    await conn.execute("UPDATE aioq.jobs SET status = 'dead' WHERE id = $1", run.jobs["part"])
    as_json = aioq_cli(dsn, "jobs", "replay", "--dead", "--task", "app.part", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["revived"] == {str(run.jobs["merge"]): "merge"}


async def test_dashboard_shows_runs_and_links_steps_to_their_jobs(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(name="app.step")
    async def step(n: int) -> None:
        pass

    run = await aioq.group(
        step.call(n=1), step.call(n=2), then=step.call(n=3), name="nightly"
    ).defer(conn)
    other = await aioq.chain(step.call(n=1), step.call(n=2), name="other").defer(conn)
    await aioq.admin.cancel_jobs(conn, [other.jobs["step"]])  # its dependent is cancelled with it
    with TestClient(aioq.web.app(dsn=dsn)) as client:
        listing = client.get("/workflows")
        assert listing.status_code == 200
        assert f'<a href="/workflows/{run.id}">{run.id}</a>' in listing.text
        assert re.search(r"<span class=\"badge cancelled\">cancelled</span>", listing.text)
        page = client.get(f"/workflows/{run.id}")
        assert page.status_code == 200
        for name, job_id in run.jobs.items():
            row = re.search(rf'<tr data-step="{name}">(.*?)</tr>', page.text, re.DOTALL)
            assert row is not None, name
            assert f'<a href="/jobs/{job_id}">{job_id}</a>' in row.group(1)
        last = re.search(r'<tr data-step="step-3">(.*?)</tr>', page.text, re.DOTALL)
        assert last is not None
        assert "badge waiting" in last.group(1)
        assert "step, step-2" in last.group(1)
        cancelled = client.get(f"/workflows/{other.id}")
        assert "DependencyFailed: step &#39;step&#39;" in cancelled.text
        job = client.get(f"/jobs/{run.jobs['step-3']}")
        assert f'<a id="workflow" href="/workflows/{run.id}">run {run.id}</a>' in job.text
        assert "badge waiting" in job.text
        overview = client.get("/")
        cell = re.search(r'data-col="waiting"><a[^>]*>(\d+)</a>', overview.text)
        assert cell is not None
        assert cell.group(1) == "1"
        assert client.get("/workflows/999").status_code == 404
    stats = await aioq.admin.stats(conn)
    assert [q.waiting for q in stats.queues] == [1]


async def test_cancel_workflow_stops_a_running_step_and_its_dependents(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    ran: list[str] = []

    @registry.task(lease=2.0)
    async def slow() -> None:
        ran.append("slow")
        await anyio.sleep_forever()

    @registry.task
    async def after() -> None:
        ran.append("after")

    run = await aioq.chain(slow.call(), after.call(), after.call()).defer(conn)
    async with make_worker(concurrency=2):
        await eventually(lambda: ran == ["slow"], "the first step running")
        states = await aioq.admin.cancel_workflow(conn, run.id)
        assert states == {
            run.jobs["slow"]: "cancelling",
            run.jobs["after"]: "cancelled",
            run.jobs["after-2"]: "cancelled",
        }

        async def slow_cancelled() -> bool:
            status = await conn.fetchval(
                "SELECT status FROM aioq.jobs WHERE id = $1", run.jobs["slow"]
            )
            return bool(status == "cancelled")

        await eventually(slow_cancelled, "the running step cancelled by its worker")
    assert await statuses(conn, run.id) == dict.fromkeys(run.jobs, "cancelled")
    assert ran == ["slow"]


async def test_200_parents_finishing_on_three_workers_release_the_fan_in_once(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """Parents complete in concurrent statements of three workers: every decrement counts
    (a lost one leaves the fan-in waiting), and the fan-in is released once."""
    joined: list[int] = []
    workers: set[str] = set()

    @registry.task(lease=2.0)
    async def parent(n: int) -> int:
        workers.add(aioq.current_job().worker_id)
        await anyio.sleep(0.01 * (n % 5))
        return n

    @registry.task
    async def join() -> None:
        joined.append(len(await aioq.current_job().upstream()))

    flow = aioq.Workflow("wide")
    parents = [flow.add(parent.call(n=i)) for i in range(200)]
    flow.add(join.call(), after=parents, name="join")
    run = await flow.defer(conn)
    async with (
        make_worker(concurrency=10),
        make_worker(concurrency=10),
        make_worker(concurrency=10),
    ):

        async def done() -> bool:
            info = await aioq.workflow(conn, run.id)
            return info is not None and info.state == "succeeded"

        await eventually(done, "the run to succeed")
    assert joined == [200]
    assert len(workers) > 1  # the parents' successes were recorded by several workers
    [listed] = await aioq.admin.list_workflows(conn)  # every success counted once on the run's row
    assert listed.counts["succeeded"] == 201


async def test_the_test_drain_runs_a_whole_run(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def step(n: int) -> int:
        return n + sum((await aioq.current_job().upstream()).values())

    run = await aioq.chain(step.call(n=1), step.call(n=10), step.call(n=100)).defer(conn)
    ran = await aioq.testing.drain(dsn, registry)
    assert [r.outcome for r in ran] == ["succeeded"] * 3
    info = await aioq.workflow(conn, run.id)
    assert info is not None
    assert [s.result for s in info.steps] == [1, 11, 111]


async def test_a_run_in_another_schema(
    dsn: str, conn: asyncpg.Connection, make_worker: Callable[..., aioq.Worker]
) -> None:
    """The fan-in statement and the triggers name the schema they were installed in."""
    await aioq.install(conn, schema="Other_1")
    other = aioq.Registry(schema="Other_1")

    @other.task(max_attempts=1)
    async def fails() -> None:
        raise RuntimeError("no")

    @other.task
    async def ok(n: int) -> int:
        return n

    flow = aioq.Workflow("elsewhere")
    first = flow.add(ok.call(n=1))
    bad = flow.add(fails.call(), after=[first])
    flow.add(ok.call(n=2), after=[bad])
    run = await flow.defer(conn)
    await make_worker(registry=other).run_until_idle()
    info = await aioq.workflow(conn, run.id, schema="Other_1")
    assert info is not None
    assert [(s.name, s.status) for s in info.steps] == [
        ("ok", "succeeded"),
        ("fails", "dead"),
        ("ok-2", "cancelled"),
    ]
    assert await aioq.workflow(conn, run.id) is None  # nothing in the default schema


async def test_a_long_chain_cascades_and_revives_in_one_statement(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    """A failure at the head of a 1 500-step chain cancels the other 1 499 and its replay
    revives them: a recursive query, not a recursion of triggers (which overflows the server's
    stack past a few hundred levels)."""

    @registry.task
    async def link(n: int) -> None:
        pass

    run = await aioq.chain(*(link.call(n=i) for i in range(1500))).defer(conn)
    head = run.jobs["link"]
    await conn.execute("UPDATE aioq.jobs SET status = 'dead' WHERE id = $1", head)  # as the reaper
    counts = "SELECT status, count(*) FROM aioq.jobs WHERE workflow_id = $1 GROUP BY status"
    assert dict(await conn.fetch(counts, run.id)) == {"dead": 1, "cancelled": 1499}
    tail = await aioq.admin.get_job(conn, run.jobs["link-1500"])
    assert tail is not None
    assert tail.last_error == f"DependencyFailed: step 'link' (job {head}) ended dead"
    assert (await aioq.admin.replay(conn, job_id=head)).replayed == [head]
    assert dict(await conn.fetch(counts, run.id)) == {"pending": 1, "waiting": 1499}


async def test_a_pool_defers_a_run_in_one_transaction_of_its_own(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    """On a pool, a failing batch leaves nothing: the run and its steps are one transaction."""

    @registry.task
    async def step(n: int) -> None:
        pass

    flow = aioq.Workflow("pooled")
    first = flow.add(step.call(n=1))
    flow.add(step.call(n=2), after=[first])
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        run = await flow.defer(pool)
        assert len(run.jobs) == 2
        await conn.execute(
            "ALTER TABLE aioq.workflow_deps ADD CONSTRAINT no_edges CHECK (false) NOT VALID"
        )
        with pytest.raises(asyncpg.CheckViolationError):
            await flow.defer(pool)
    assert await conn.fetchval("SELECT count(*) FROM aioq.workflows") == 1
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 2


async def test_a_diamond_cascades_through_steps_that_run_anyway_and_resumes(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    broken = {"yes": True}
    ran: list[str] = []

    @registry.task(max_attempts=1)
    async def head() -> int:
        if broken["yes"]:
            raise RuntimeError("boom")
        return 1

    @registry.task
    async def node(label: str) -> str:
        up = await aioq.current_job().upstream()
        failed = sorted(k for k, v in up.items() if isinstance(v, aioq.StepFailed))
        ran.append(f"{label}{failed if failed else ''}")
        return label

    flow = aioq.Workflow("diamond")
    p = flow.add(head.call(), name="p")
    a = flow.add(node.call(label="a"), after=[p], name="a")
    b = flow.add(node.call(label="b"), after=[p], name="b")
    flow.add(node.call(label="c"), after=[a, b], name="c")
    flow.add(node.call(label="r"), after=[a], name="r", on_failure="run")
    run = await flow.defer(conn)
    await make_worker().run_until_idle()
    assert await statuses(conn, run.id) == {
        "p": "dead", "a": "cancelled", "b": "cancelled", "c": "cancelled", "r": "succeeded"
    }  # fmt: skip
    assert ran == ["r['a']"]  # ran anyway, seeing its dependency failed
    c = await aioq.admin.get_job(conn, run.jobs["c"])
    assert c is not None
    assert c.last_error == f"DependencyFailed: step 'p' (job {run.jobs['p']}) ended dead"

    broken["yes"] = False
    await aioq.admin.replay(conn, job_id=run.jobs["p"])
    assert await statuses(conn, run.id) == {
        "p": "pending", "a": "waiting", "b": "waiting", "c": "waiting", "r": "succeeded"
    }  # fmt: skip
    await make_worker().run_until_idle()
    assert set((await statuses(conn, run.id)).values()) == {"succeeded"}
    assert sorted(ran[1:]) == ["a", "b", "c"]


async def test_dashboard_actions_replay_a_runs_dead_steps_and_cancel_the_run(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    fail = True

    @registry.task(name="app.charge", max_attempts=1)
    async def charge() -> None:
        if fail:
            raise RuntimeError("card declined")

    @registry.task(name="app.ship")
    async def ship() -> None: ...

    run = await aioq.chain(charge.call(), ship.call(), name="order").defer(conn)
    await make_worker().run_until_idle()

    def act(client: TestClient, button: str) -> str:
        page = client.get(f"/workflows/{run.id}").text
        form = re.search(
            rf'<form method="post"[^>]*>(?:(?!</form>).)*{button}.*?</form>', page, re.S
        )
        assert form is not None, (button, page)
        fields = re.findall(r'name="(\w+)" value="([^"]*)"', form.group(0))
        data: dict[str, Any] = {k: v for k, v in fields if k != "ids"}
        response = client.post(
            "/actions",
            data={**data, "ids": [v for k, v in fields if k == "ids"]},
            follow_redirects=False,
        )
        assert response.status_code == 303, response.text
        return str(response.headers["location"])

    with TestClient(aioq.web.app(dsn=dsn, actions=True)) as client:
        # The charge died and its dependent was cancelled: nothing live to cancel.
        page = client.get(f"/workflows/{run.id}").text
        assert "Cancel run" not in page
        replayed = act(client, r"Replay dead steps \(1\)")
        assert replayed.startswith(f"/workflows/{run.id}?done=")
        flash = client.get(replayed).text
        assert f"replayed 1 of 1 job (1 dependent step revived: {run.jobs['ship']})" in flash
        info = await aioq.workflow(conn, run.id)
        assert info is not None
        assert {s.name: s.status for s in info.steps} == {"charge": "pending", "ship": "waiting"}
        # Both steps are live again: cancel the run from its page.
        assert "Replay dead steps" not in client.get(f"/workflows/{run.id}").text
        act(client, "Cancel run")
    info = await aioq.workflow(conn, run.id)
    assert info is not None
    assert {s.status for s in info.steps} == {"cancelled"}
    assert {s.last_error for s in info.steps} == {f"cancelled: workflow run {run.id} cancelled"}
    assert set(run.jobs.values()) == {s.job_id for s in info.steps}
    # A read-only dashboard shows neither button.
    with TestClient(aioq.web.app(dsn=dsn)) as client:
        page = client.get(f"/workflows/{run.id}").text
        assert "<form" not in page


async def test_a_cancelled_runs_steps_say_why_across_workers_a_hard_cancel_and_the_reaper(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    """cancel_workflow gives every step it cancels a last_error naming the run, whichever path
    ends it: cancelled at once (waiting, pending), by its worker's cancel (running), by the
    release of a hard-cancelled worker, or by the reaper after its worker vanished."""
    running: set[int] = set()

    @registry.task(lease=1.0)
    async def slow(n: int) -> None:
        running.add(aioq.current_job().id)
        await anyio.sleep_forever()

    @registry.task
    async def after() -> None: ...

    flow = aioq.Workflow("doomed")
    parts = [flow.add(slow.call(n=i)) for i in range(8)]
    join = flow.add(after.call(), after=parts, name="join")
    flow.add(after.call(), after=[join], name="end")
    run = await flow.defer(conn)
    # One step held by a worker that vanished (a SIGKILL): only the reaper can end it.
    [lost] = await statements.claim(conn, ["default"], 1, "vanished")
    lease = "UPDATE aioq.jobs SET lease_expires_at = now() + $2::text::interval WHERE id = $1"
    await conn.execute(lease, lost.id, "1 hour")  # until the test says it expired
    options = {"concurrency": 2, "heartbeat_interval": 0.2, "reaper_interval": 0.2}
    with anyio.fail_after(60):
        async with three_workers(make_worker, **options) as doomed:
            await eventually(lambda: len(running) == 6, "six steps running on three workers")
            states = await aioq.admin.cancel_workflow(conn, run.id)
            doomed.cancel()  # one worker is cut off mid-flight, its claims released
            assert states[lost.id] == "cancelling"
            assert list(states.values()).count("cancelling") == 7
            await conn.execute(lease, lost.id, "-1 second")
            await until_sql(
                conn,
                "SELECT NOT EXISTS (SELECT FROM aioq.jobs"
                " WHERE status IN ('waiting', 'pending', 'running'))",
            )
    reason = f"cancelled: workflow run {run.id} cancelled"
    info = await aioq.workflow(conn, run.id)
    assert info is not None
    assert info.state == "cancelled"
    assert {s.name: (s.status, s.last_error) for s in info.steps} == {
        s.name: ("cancelled", reason) for s in info.steps
    }
    job = await aioq.admin.get_job(conn, run.jobs["end"])
    assert job is not None
    assert job.last_error == reason
    shown = aioq_cli(dsn, "jobs", "show", str(lost.id))
    assert shown.returncode == 0, shown.stderr
    assert reason in shown.stdout
    with TestClient(aioq.web.app(dsn=dsn)) as client:
        page = client.get(f"/jobs/{run.jobs['join']}").text
        assert f'<pre class="error" id="last-error">{reason}</pre>' in page


async def test_a_replay_names_the_steps_it_revives_and_the_run_resumes_across_workers(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """A step dies while its siblings run on three workers with short leases; its replay
    (while one worker is hard-cancelled) names exactly the steps its death cancelled, and the
    fan-in after it runs once."""
    broken = True
    merged: list[int] = []
    notified: list[str] = []

    @registry.task(lease=1.0, max_attempts=1)
    async def part(n: int) -> int:
        if n == 0 and broken:
            raise RuntimeError("boom")
        await anyio.sleep(0.01 * (n % 7))
        return n

    @registry.task(lease=1.0)
    async def merge() -> int:
        merged.append(len(await aioq.current_job().upstream()))
        return 1

    @registry.task(lease=1.0)
    async def notify() -> None:
        notified.append("sent")

    flow = aioq.Workflow("resumed")
    parts = [flow.add(part.call(n=i)) for i in range(40)]
    done = flow.add(merge.call(), after=parts, name="merge")
    flow.add(notify.call(), after=[done], name="notify")
    flow.add(notify.call(), after=parts[1:3], name="unrelated")  # not blocked by part 0
    run = await flow.defer(conn)
    options = {"concurrency": 3, "heartbeat_interval": 0.2, "reaper_interval": 0.2}

    async def succeeded() -> bool:
        info = await aioq.workflow(conn, run.id)
        return info is not None and info.state == "succeeded"

    with anyio.fail_after(60):
        async with three_workers(make_worker, **options) as doomed:
            await until_sql(
                conn,
                "SELECT status = 'cancelled' FROM aioq.jobs WHERE id = $1",
                run.jobs["notify"],
            )
            broken = False
            replay = await aioq.admin.replay(conn, job_id=run.jobs["part"])
            doomed.cancel()  # one worker is cut off mid-flight, claims and all
            assert replay.replayed == [run.jobs["part"]]
            assert replay.revived == {run.jobs["merge"]: "merge", run.jobs["notify"]: "notify"}
            await eventually(succeeded, "the run to resume and succeed")
    assert merged == [40]
    assert notified.count("sent") == 2  # notify and unrelated, once each


async def test_a_steps_delay_counts_from_its_last_dependencys_success(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """A waiting step's delay starts when it becomes ready: the statement that records its
    last dependency's success (or, for on_failure="run", its end) sets run_at = now + delay.
    A step without dependencies counts from the defer."""

    @registry.task(max_attempts=1)
    async def first(fail: bool = False) -> None:
        if fail:
            raise RuntimeError("boom")

    @registry.task
    async def later() -> None: ...

    hour = 3600.0
    flow = aioq.Workflow("delays")
    a = flow.add(first.call())
    flow.add(later.options(delay=2 * hour).call(), after=[a], name="delayed")
    flow.add(later.options(delay=0).call(), after=[a], name="at-once")
    bad = flow.add(first.call(fail=True), name="bad")
    flow.add(later.options(delay=2 * hour).call(), after=[bad], name="anyway", on_failure="run")
    flow.add(later.options(delay=2 * hour).call(), name="root")  # no dependency: from the defer
    run = await flow.defer(conn)
    # As if the run was deferred a day ago: a delay counted from the defer would be over.
    await conn.execute(
        "UPDATE aioq.jobs SET run_at = now() - interval '1 day'"
        " WHERE workflow_id = $1 AND status = 'waiting'",
        run.id,
    )
    await make_worker().run_until_idle()
    assert await statuses(conn, run.id) == {
        "first": "succeeded",
        "delayed": "pending",
        "at-once": "succeeded",
        "bad": "dead",
        "anyway": "pending",
        "root": "pending",
    }
    rows = await conn.fetch(
        """
        SELECT s.name, extract(epoch FROM j.run_at - p.ended)::float8 AS after_ready,
               extract(epoch FROM j.run_at - w.created_at)::float8 AS after_defer
        FROM aioq.workflow_steps AS s
        JOIN aioq.jobs AS j ON j.id = s.job_id
        JOIN aioq.workflows AS w ON w.id = s.workflow_id
        CROSS JOIN LATERAL (
            SELECT max(coalesce(ps.succeeded_at, pj.run_at)) AS ended
            FROM aioq.workflow_deps AS d
            JOIN aioq.workflow_steps AS ps ON ps.job_id = d.parent_id
            LEFT JOIN aioq.jobs AS pj ON pj.id = d.parent_id
            WHERE d.job_id = s.job_id
        ) AS p
        WHERE s.workflow_id = $1 AND j.status = 'pending'
        """,
        run.id,
    )
    by_name = {r["name"]: r for r in rows}
    for name in ("delayed", "anyway"):  # from the moment it became ready
        assert 2 * hour - 5 <= by_name[name]["after_ready"] <= 2 * hour, dict(by_name[name])
    assert abs(by_name["root"]["after_defer"] - 2 * hour) < 5  # from the defer


async def test_a_delayed_fan_in_waits_its_delay_after_the_last_parent_across_workers(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """Parents succeed on three workers with short leases, one worker hard-cancelled midway:
    the delayed fan-in runs once, its delay counted from the last parent's success."""
    joined: list[int] = []

    @registry.task(lease=1.0)
    async def parent(n: int) -> int:
        await anyio.sleep(0.01 * (n % 5))
        return n

    @registry.task(lease=1.0, result_ttl=600)
    async def join() -> None:
        joined.append(len(await aioq.current_job().upstream()))

    flow = aioq.Workflow("delayed-join")
    parents = [flow.add(parent.call(n=i)) for i in range(60)]
    flow.add(join.options(delay=1.0).call(), after=parents, name="join")
    run = await flow.defer(conn)
    await conn.execute(  # counted from the defer, the delay would be long over
        "UPDATE aioq.jobs SET run_at = now() - interval '1 day' WHERE id = $1", run.jobs["join"]
    )
    options = {"concurrency": 4, "heartbeat_interval": 0.2, "reaper_interval": 0.2}
    with anyio.fail_after(60):
        async with three_workers(make_worker, **options) as doomed:
            await until_sql(
                conn,
                "SELECT count(*) >= 20 FROM aioq.workflow_steps"
                " WHERE workflow_id = $1 AND succeeded_at IS NOT NULL",
                run.id,
            )
            doomed.cancel()  # one worker is cut off mid-flight, claims and all
            await until_sql(
                conn, "SELECT EXISTS (SELECT FROM aioq.results WHERE id = $1)", run.jobs["join"]
            )
    assert joined == [60]
    [listed] = await aioq.admin.list_workflows(conn)  # counted once each, hard cancel and all
    assert (listed.state, listed.counts["succeeded"]) == ("succeeded", 61)
    waited = await conn.fetchval(
        """
        SELECT extract(epoch FROM r.started_at - (SELECT max(succeeded_at)
                                                   FROM aioq.workflow_steps
                                                   WHERE workflow_id = $1 AND name <> 'join'))
        FROM aioq.results AS r WHERE r.id = $2
        """,
        run.id,
        run.jobs["join"],
    )
    assert waited >= 0.9, waited  # the delay, counted from the last parent's success


async def _tuples_read(conn: asyncpg.Connection) -> int:
    """Index entries and rows this database has read so far from the workflow tables (this
    session's statistics flushed first)."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(
        await conn.fetchval(
            """
            SELECT (SELECT sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0))
                    FROM pg_stat_user_tables WHERE schemaname = 'aioq')
                 + (SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE schemaname = 'aioq')
            """
        )
    )


async def test_the_workflows_list_counts_a_huge_run_within_a_bound(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The list counts each status of a run's steps still in the jobs table up to a bound
    ("1000+"), reading a bounded index range per status however many steps the run has, and
    shows its succeeded steps from the run's own count; the run's page counts them all."""

    @registry.task(name="app.step")
    async def step(n: int) -> None: ...

    n = 20_000
    flow = aioq.group(*(step.call(n=i) for i in range(n)), then=step.call(n=-1), name="huge")
    run = await flow.defer(conn)
    small = await aioq.chain(step.call(n=1), step.call(n=2), name="small").defer(conn)
    # 12 000 steps succeeded (written as a worker writes them), 3 000 dead, the rest pending.
    for _ in range(12):
        claims = await statements.claim(conn, ["default"], 1000, "w")
        written = await statements.write(conn, "w", claims, OutcomeKind.SUCCEEDED, steps=True)
        assert len(written) == 1000
    ids = sorted(run.jobs.values())[:n]
    await conn.execute(
        "UPDATE aioq.jobs SET status = 'dead', run_at = now() WHERE id = ANY($1)",
        ids[12_000:15_000],
    )
    bound = 1000
    monkeypatch.setattr(importlib.import_module("aioq.workflows"), "LIST_COUNT_LIMIT", bound)
    # The deleted rows' index entries go with the next vacuum (the worker's vacuumer, or
    # autovacuum), as for every index of the jobs table; until then a scan steps over them.
    await conn.execute("VACUUM (INDEX_CLEANUP ON) aioq.jobs")
    await conn.execute("ALTER TABLE aioq.jobs SET (autovacuum_enabled = false)")
    await conn.execute("ALTER TABLE aioq.workflow_steps SET (autovacuum_enabled = false)")
    for analyzed in (False, True):  # a run inserted since the last ANALYZE, and after one
        if analyzed:
            await conn.execute("ANALYZE aioq.jobs; ANALYZE aioq.workflow_steps")
        before = await _tuples_read(conn)
        little, huge = await aioq.admin.list_workflows(conn)  # newest first
        read = await _tuples_read(conn) - before
        # Five bounded index ranges per run (each its entries and rows), not 20 000 steps.
        assert read <= 2 * 5 * (bound + 1) + 100, (analyzed, read)
        assert huge.state == "running"
        assert {c: huge.count_text(c) for c in huge.counts} == {
            "waiting": "0",
            "pending": "1000+",
            "running": "0",
            "succeeded": "12000",  # the run's own count: exact
            "dead": "1000+",
            "cancelled": "1",  # the fan-in, cancelled as its dead dependencies died
        }
        assert little.counts == {
            "waiting": 1, "pending": 1, "running": 0, "succeeded": 0, "dead": 0, "cancelled": 0
        }  # fmt: skip
    info = await aioq.workflow(conn, run.id)  # the run's page counts every step
    assert info is not None
    assert info.counts["succeeded"] == 12_000
    assert info.counts["pending"] == 5_000
    with TestClient(aioq.web.app(dsn=dsn)) as client:
        page = client.get("/workflows").text
    assert re.search(rf'<tr data-run="{run.id}">.*?data-col="pending">1000\+</td>', page, re.S)
    assert re.search(rf'<tr data-run="{run.id}">.*?data-col="succeeded">12000</td>', page, re.S)
    assert re.search(rf'<tr data-run="{small.id}">.*?data-col="waiting">1</td>', page, re.S)
    listed = aioq_cli(dsn, "workflows", "list")  # its own process: the real bound, 10 000
    assert listed.returncode == 0, listed.stderr
    [row] = [line.split() for line in listed.stdout.splitlines() if " huge " in line]
    assert row[-6:] == ["0", "5000", "0", "12000", "3000", "1"], listed.stdout


# --- a run is written whole, whatever the connection's state ------------------------------


def _autocommit_deferrers(dsn: str) -> dict[str, Callable[[aioq.Workflow], Any]]:
    """Each kind of connection aioq defers a run on, in autocommit (no transaction open: each
    statement the caller runs commits on its own): an async ``flow.defer`` or a sync
    ``flow.defer_sync`` (run in a thread), each returning the WorkflowRun."""
    import psycopg
    import sqlalchemy
    from sqlalchemy.ext.asyncio import create_async_engine

    async def on_asyncpg(flow: aioq.Workflow) -> aioq.workflows.WorkflowRun:
        conn = await asyncpg.connect(dsn)
        try:
            assert not conn.is_in_transaction()
            return await flow.defer(conn)
        finally:
            await conn.close()

    async def on_sqlalchemy_async(flow: aioq.Workflow) -> aioq.workflows.WorkflowRun:
        url = dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
        engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
        try:
            async with engine.connect() as conn:
                return await flow.defer(conn)
        finally:
            await engine.dispose()

    def psycopg_sync(flow: aioq.Workflow) -> aioq.workflows.WorkflowRun:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return flow.defer_sync(conn)

    def sqlalchemy_sync(flow: aioq.Workflow) -> aioq.workflows.WorkflowRun:
        url = dsn.replace("postgresql://", "postgresql+psycopg://", 1)
        engine = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                return flow.defer_sync(conn)
        finally:
            engine.dispose()

    def in_thread(defer: Callable[[aioq.Workflow], Any]) -> Callable[[aioq.Workflow], Any]:
        async def run(flow: aioq.Workflow) -> Any:
            return await anyio.to_thread.run_sync(defer, flow)

        return run

    return {
        "asyncpg": on_asyncpg,
        "sqlalchemy-async": on_sqlalchemy_async,
        "psycopg-sync": in_thread(psycopg_sync),
        "sqlalchemy-sync": in_thread(sqlalchemy_sync),
    }


@pytest.mark.parametrize("kind", ["asyncpg", "sqlalchemy-async", "psycopg-sync", "sqlalchemy-sync"])
async def test_a_run_deferred_in_autocommit_is_written_whole_while_workers_run(
    kind: str,
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    """A run of 8 002 steps deferred on a connection in autocommit (as the docs'
    ``aioq.chain(...).defer(conn)`` calls it) is written whole, in one transaction: its root
    cannot run and succeed before the edge to its last step exists, which would strand that
    step for ever (docs/architecture.md, "Workflows").

    A third transaction holds the edge root -> last (its uncommitted insert of the same key),
    so the write of that edge waits; meanwhile a worker runs whatever of the run is visible.
    Written in pieces, the root was visible, ran and succeeded first, and the last step waited
    for it for ever."""
    root_ran, last_ran = anyio.Event(), anyio.Event()

    @registry.task(queue="flow")
    async def root() -> None:
        root_ran.set()

    @registry.task(queue="flow")
    async def last() -> None:
        last_ran.set()

    @registry.task(queue="idle")  # no worker serves it
    async def filler(n: int) -> None:
        pass

    flow = aioq.Workflow("autocommit")
    first = flow.add(root.call())
    for i in range(8_000):
        flow.add(filler.call(n=i))
    flow.add(last.call(), after=[first], name="last")
    # The ids the run's steps take: the next values of the jobs' identity sequence.
    next_id = await conn.fetchval(
        "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM aioq.jobs_id_seq"
    )
    root_id, last_id = next_id, next_id + 8_001
    defer = _autocommit_deferrers(dsn)[kind]
    ran: list[aioq.workflows.WorkflowRun] = []
    deferred = anyio.Event()
    worker = make_worker(queues=["flow"])
    blocker = await asyncpg.connect(dsn)
    try:
        blocking = blocker.transaction()
        await blocking.start()
        await blocker.execute(
            "INSERT INTO aioq.workflow_deps (parent_id, job_id) VALUES ($1, $2)", root_id, last_id
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)

            async def deferring() -> None:
                ran.append(await defer(flow))
                deferred.set()

            tg.start_soon(deferring)
            try:
                # The defer waits for the blocker's edge ...
                await until_sql(
                    conn,
                    "SELECT EXISTS (SELECT FROM pg_stat_activity"
                    " WHERE $1 = ANY(pg_blocking_pids(pid)))",
                    blocker.get_server_pid(),
                    guard=30,
                )
                # ... while a worker runs the root, if a part of the run was committed already.
                await until_sql(
                    conn,
                    "SELECT coalesce((SELECT succeeded_at IS NOT NULL FROM aioq.workflow_steps"
                    " WHERE job_id = $1), true)",
                    root_id,
                    guard=30,
                )
                seen_while_writing = await conn.fetchval("SELECT count(*) FROM aioq.jobs")
            finally:
                await blocking.rollback()
            with anyio.fail_after(30):
                await deferred.wait()
                await root_ran.wait()
            await until_sql(
                conn,
                "SELECT succeeded_at IS NOT NULL FROM aioq.workflow_steps WHERE job_id = $1",
                root_id,
                guard=30,
            )
            # The root's success is recorded: the statement that recorded it released its
            # dependent, or nothing ever will.
            status = await conn.fetchval("SELECT status FROM aioq.jobs WHERE id = $1", last_id)
            worker.stop()
            assert status != "waiting", "the last step waits for a root that succeeded already"
            with anyio.fail_after(30):
                await last_ran.wait()
    finally:
        await blocker.close()
    assert [run.jobs["last"] for run in ran] == [last_id]
    assert seen_while_writing == 0  # no step of the run was visible before its commit


# --- state decides, never the text of an error ----------------------------------------------


class DependencyFailed(Exception):
    """An application's own error whose name reads like the workflow trigger's reason."""


async def test_a_cancel_whose_reason_reads_like_the_cascade_still_cascades(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """The workflow trigger tells the steps it cancels apart by their state (``blocked_by``),
    not by a ``last_error`` starting with ``DependencyFailed:``: a step cancelled with such a
    reason cancels its dependents (they waited for ever), and a step that died of an error of
    that name cancels its dependents and revives them when replayed."""
    broken = {"yes": True}
    ran: list[str] = []

    @registry.task(max_attempts=1)
    async def step(name: str) -> None:
        if name == "x" and broken["yes"]:
            raise DependencyFailed("x is broken")
        ran.append(name)

    spoofed = await aioq.chain(*(step.call(name=n) for n in "abcd")).defer(conn)
    _, b, c, d = (spoofed.jobs[n] for n in ("step", "step-2", "step-3", "step-4"))
    states = await aioq.admin.cancel_jobs(conn, [b], reason="DependencyFailed: spoof")
    assert states == {b: "cancelled"}
    assert await statuses(conn, spoofed.id) == {
        "step": "pending",
        "step-2": "cancelled",
        "step-3": "cancelled",
        "step-4": "cancelled",
    }
    rows = await conn.fetch(
        "SELECT id, blocked_by, last_error FROM aioq.jobs WHERE id = ANY($1) ORDER BY id",
        [b, c, d],
    )
    because = f"DependencyFailed: step 'step-2' (job {b}) ended cancelled"
    assert [tuple(r) for r in rows] == [
        (b, None, "DependencyFailed: spoof"),
        (c, b, because),
        (d, c, because),
    ]
    # A step whose own error is named so: a real death, cascading; its replay revives.
    failing = await aioq.chain(*(step.call(name=n) for n in "xyz")).defer(conn)
    await make_worker().run_until_idle()
    assert ran == ["a"]
    assert await statuses(conn, failing.id) == {
        "step": "dead",
        "step-2": "cancelled",
        "step-3": "cancelled",
    }
    x = failing.jobs["step"]
    dead = await aioq.admin.get_job(conn, x)
    assert dead is not None
    assert dead.last_error is not None
    assert dead.last_error.startswith("DependencyFailed: x is broken\n")
    broken["yes"] = False
    replay = await aioq.admin.replay(conn, job_id=x)
    assert replay.revived == {failing.jobs["step-2"]: "step-2", failing.jobs["step-3"]: "step-3"}
    await make_worker().run_until_idle()
    assert ran == ["a", "x", "y", "z"]
    blocked = await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE blocked_by IS NOT NULL")
    assert blocked == 2  # the spoofed run's: c and d, cancelled for good with b
