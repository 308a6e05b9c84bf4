"""Issue 11, the first hour with aioq: default queues, clear defer errors, annotations checked at
defer, finished jobs found in the archive, a worker on the application's pool, job_context."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, TypedDict, Union

import anyio
import anyio.lowlevel
import asyncpg
import pytest

import aioq
from aioq.testing import job_context
from aioq.worker.producer import Handoff

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0
MakeWorker = Callable[..., aioq.Worker]


async def run_until_idle(worker: aioq.Worker) -> None:
    with anyio.fail_after(HANG_GUARD):
        await worker.run_until_idle()


async def count_jobs(conn: asyncpg.Connection) -> int:
    return await conn.fetchval("SELECT count(*) FROM aioq.jobs")  # type: ignore[no-any-return]


# 1. Queues ----------------------------------------------------------------------------------


def test_registry_queues_are_default_and_every_queue_a_task_names(
    registry: aioq.Registry,
) -> None:
    assert registry.queues() == ("default",)

    @registry.task(name="mail", queue="email")
    async def mail() -> None: ...

    @registry.task(name="charge", queue="billing")
    async def charge() -> None: ...

    @registry.task(name="plain")
    async def plain() -> None: ...

    assert registry.queues() == ("default", "billing", "email")
    assert [t.name for t in registry.unserved(["default", "email"])] == ["charge"]


async def test_a_worker_given_no_queues_serves_every_queue_its_tasks_name(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []

    @registry.task(name="mail", queue="email")
    async def mail(to: str) -> None:
        ran.append(to)

    @registry.task(name="plain")
    async def plain(to: str) -> None:
        ran.append(to)

    await mail.defer(conn, to="a")
    await plain.defer(conn, to="b")
    await mail.options(queue="default").defer(conn, to="c")
    caplog.set_level(logging.INFO, logger="aioq")
    worker = make_worker()
    assert worker.config.queues == ("default", "email")
    await run_until_idle(worker)
    assert sorted(ran) == ["a", "b", "c"]
    assert await count_jobs(conn) == 0
    assert "serving queues default,email" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_worker_given_queues_names_the_tasks_it_leaves_out_in_its_start_line(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @registry.task(name="mail", queue="email")
    async def mail() -> None: ...

    @registry.task(name="charge", queue="billing")
    async def charge() -> None: ...

    @registry.task(name="refund", queue="billing")
    async def refund() -> None: ...

    @registry.task(name="plain")
    async def plain() -> None: ...

    caplog.set_level(logging.INFO, logger="aioq.worker")
    waiting = await mail.defer(conn)
    await run_until_idle(make_worker(queues=["default", "billing"]))
    # Queues chosen explicitly: no warning, and the start line names what is left out.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    [started] = [r.getMessage() for r in caplog.records if "serving queues" in r.getMessage()]
    assert started.endswith(
        "serving queues default,billing with 10 consumers; tasks of other queues, left to"
        " other workers: mail (email)"
    )
    # The job waits for a worker that serves its queue; nothing was lost.
    assert await conn.fetchval("SELECT status FROM aioq.jobs WHERE id = $1", waiting) == "pending"

    caplog.clear()
    for n in range(5):
        registry.task(name=f"report{n}", queue="reports")(plain.fn)
    narrow = make_worker(queues="billing")
    await run_until_idle(narrow)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    lines = [r.getMessage() for r in caplog.records if narrow.id in r.getMessage()]
    [started] = [line for line in lines if "serving queues" in line]
    assert started.endswith(
        "left to other workers: mail (email), plain (default), report0 (reports),"
        " report1 (reports), report2 (reports) and 2 more"
    )
    # The troubleshooting guide quotes this line as printed.
    quoted = started.replace(narrow.id, "...", 1).split("; ", 1)[1].split(":", 1)[0]
    assert quoted in TROUBLESHOOTING


# The operations guide, whose Troubleshooting section quotes messages as printed.
TROUBLESHOOTING = " ".join(
    (Path(__file__).parent.parent / "docs" / "operations-and-cli.md").read_text().split()
)


# 5. Messages that name what is wrong ---------------------------------------------------------


async def test_defer_names_the_unexpected_and_the_missing_argument(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(name="f")
    async def f(x: int, flag: bool = False) -> None: ...

    bad: Any = f
    with pytest.raises(aioq.ArgumentError) as caught:
        await bad.defer(conn, y=1)
    assert str(caught.value) == (
        "cannot defer 'f': unexpected argument 'y'; missing required argument 'x'"
        " (the task takes (x, flag=False))"
    )
    with pytest.raises(aioq.ArgumentError, match="argument 'x' given twice"):
        await bad.defer(conn, 1, x=2)
    with pytest.raises(aioq.ArgumentError, match="3 positional arguments given, at most 2"):
        await bad.defer(conn, 1, True, 3)
    with pytest.raises(aioq.ArgumentError, match="unexpected arguments 'a', 'b'; missing"):
        await f.defer_many(conn, [{"x": 1}, {"a": 1, "b": 2}])
    assert await count_jobs(conn) == 0


# 6. Simple annotations are checked at defer --------------------------------------------------


class Point(TypedDict):
    x: int
    y: float


@pytest.fixture
def typed(registry: aioq.Registry) -> aioq.Task[..., None]:
    @registry.task(name="typed")
    async def typed(
        n: int,
        ratio: float,
        name: str,
        on: bool,
        note: str | None,
        ids: list[int],
        flags: dict[str, bool],
        point: Optional[Point] = None,  # noqa: UP045 (typing.Optional is checked too)
        either: Union[int, str] = 0,  # noqa: UP007
        anything: Any = None,
        loose: list = [],  # noqa: B006, the bare container type only
        mine: Undeclared = None,  # type: ignore[name-defined]  # noqa: F821 unresolvable
        **more: int,
    ) -> None: ...

    return typed


GOOD: dict[str, Any] = {
    "n": 1,
    "ratio": 2,
    "name": "a",
    "on": True,
    "note": None,
    "ids": [1, 2],
    "flags": {"k": False},
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n": "not-an-int"}, "argument 'n' must be int, got str 'not-an-int'"),
        ({"n": True}, "argument 'n' must be int, got bool True"),
        ({"n": 1.0}, "argument 'n' must be int, got float 1.0"),
        ({"ratio": False}, "argument 'ratio' must be float, got bool False"),
        ({"name": 3}, "argument 'name' must be str, got int 3"),
        ({"on": 1}, "argument 'on' must be bool, got int 1"),
        ({"note": 1}, "argument 'note' must be str, got int 1"),
        ({"ids": [1, "2"]}, "argument 'ids[1]' must be int, got str '2'"),
        ({"ids": {"a": 1}}, "argument 'ids' must be list[int], got dict {'a': 1}"),
        ({"flags": {"k": "yes"}}, "argument \"flags['k']\" must be bool, got str 'yes'"),
        ({"point": {"x": 1}}, "argument 'point' lacks the key 'y', which Point requires"),
        ({"point": {"x": 1, "y": 2, "z": 3}}, "has the key 'z', which Point does not declare"),
        ({"point": {"x": 1.5, "y": 2}}, "argument \"point['x']\" must be int, got float 1.5"),
        ({"either": 1.5}, "argument 'either' must be int | str, got float 1.5"),
        ({"loose": {}}, "argument 'loose' must be list, got dict {}"),
        ({"extra": "x"}, "argument 'extra' must be int, got str 'x'"),
    ],
)
async def test_simple_annotations_are_checked_before_anything_is_written(
    conn: asyncpg.Connection, typed: aioq.Task[..., None], change: dict[str, Any], message: str
) -> None:
    with pytest.raises(aioq.ArgumentError) as caught:
        await typed.defer(conn, **{**GOOD, **change})
    assert caught.value.task_name == "typed"
    assert message in str(caught.value)
    assert str(caught.value).startswith("cannot defer 'typed': ")
    with pytest.raises(aioq.ArgumentError) as many:
        await typed.defer_many(conn, [GOOD, {**GOOD, **change}])
    assert str(many.value) == str(caught.value)
    assert await count_jobs(conn) == 0


async def test_values_the_annotations_allow_are_deferred(
    conn: asyncpg.Connection, typed: aioq.Task[..., None]
) -> None:
    allowed = [
        {},
        {"ratio": 2.5, "note": "n", "ids": [], "flags": {}},
        {"point": {"x": 1, "y": 2}, "either": "s", "anything": {"a": [1, "b"]}},
        {"mine": "unchecked", "loose": [1, "a"], "extra": 7},
    ]
    for change in allowed:
        await typed.defer(conn, **{**GOOD, **change})
    rows = await conn.fetch("SELECT args::text FROM aioq.jobs ORDER BY id")
    assert [json.loads(r[0]) for r in rows] == [{**GOOD, **c} for c in allowed]


# 3. Finished jobs in the archive -------------------------------------------------------------


async def test_get_job_finds_a_succeeded_job_in_the_archive(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="t.kept", queue="q")
    async def kept(i: int) -> None:
        pass

    first, second = await kept.defer_many(conn, [{"i": 1}, {"i": 2}])
    worker = make_worker(keep_completed=True)
    await run_until_idle(worker)
    job = await aioq.admin.get_job(conn, first)
    assert job is not None
    assert job.status is aioq.admin.JobStatus.SUCCEEDED
    assert (job.id, job.task, job.queue, json.loads(job.args)) == (first, "t.kept", "q", {"i": 1})
    assert job.locked_by == worker.id
    assert job.attempts == 1
    assert job.finished_at is not None
    assert job.locked_at is not None
    assert job.created_at <= job.locked_at <= job.finished_at
    listed = await aioq.admin.list_jobs(conn, status="succeeded", task="t.kept")
    assert [j.id for j in listed] == [first, second]
    assert await aioq.admin.list_jobs(conn, status="succeeded", queue="other") == []

    # Without keep_completed the job is deleted: nothing to find.
    gone = await kept.defer(conn, i=3)
    await run_until_idle(make_worker())
    assert await aioq.admin.get_job(conn, gone) is None
    pending = await kept.options(delay=3600).defer(conn, i=4)
    found = await aioq.admin.get_job(conn, pending)
    assert found is not None
    assert found.status is aioq.admin.JobStatus.PENDING
    assert found.finished_at is None


async def test_released_jobs_are_found_succeeded_with_the_worker_that_finished_them(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    started = anyio.Event()

    @registry.task(name="t.mail", queue="email", lease=1.0)
    async def mail(i: int) -> None:
        started.set()
        await anyio.sleep(0.2)

    ids = await mail.defer_many(conn, [{"i": i} for i in range(8)])
    # A worker serving only "default" never touches them; one given no queues serves "email".
    bystander = make_worker(queues=["default"], keep_completed=True)
    victim = make_worker(keep_completed=True, concurrency=4, heartbeat_interval=0.2)
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(bystander.run)
            tg.start_soon(victim.run)
            await started.wait()
            tg.cancel_scope.cancel()  # a hard cancel of both, jobs running
    finishers = [make_worker(keep_completed=True, concurrency=2) for _ in range(2)]
    async with anyio.create_task_group() as tg:
        for worker in finishers:
            tg.start_soon(run_until_idle, worker)
    assert await count_jobs(conn) == 0
    found = [await aioq.admin.get_job(conn, job_id) for job_id in ids]
    assert all(j is not None and j.status is aioq.admin.JobStatus.SUCCEEDED for j in found)
    owners = {j.locked_by for j in found if j is not None}
    assert owners <= {victim.id, *(w.id for w in finishers)}
    assert owners & {w.id for w in finishers}  # the released jobs were finished by others
    assert bystander.id not in owners
    archived = await conn.fetchval("SELECT count(*) FROM aioq.archive")
    assert archived == len(ids)  # each job archived once


# 7. A worker on the application's pool -------------------------------------------------------


async def _json_codec(connection: asyncpg.Connection) -> None:
    await connection.set_type_codec(
        "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
    )


async def test_workers_share_the_applications_pool_and_leave_it_open(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    runs: list[tuple[int, int]] = []
    started = anyio.Event()

    @registry.task(name="t.slow", lease=1.0)
    async def slow(i: int, pause: float) -> None:
        started.set()
        runs.append((i, aioq.current_job().attempt))
        await anyio.sleep(pause)

    # An application pool as many are built: its own jsonb codec, no command_timeout.
    async with asyncpg.create_pool(dsn, min_size=1, max_size=8, init=_json_codec) as pool:
        async with pool.acquire() as app_conn, app_conn.transaction():
            ids = await slow.defer_many(app_conn, [{"i": i, "pause": 0.3} for i in range(6)])
        names = "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                victim = make_worker(pool=pool, concurrency=3, heartbeat_interval=0.2)
                tg.start_soon(victim.run)
                await started.wait()
                apps = [r[0] for r in await conn.fetch(names)]
                tg.cancel_scope.cancel()  # a hard cancel, jobs running
        assert victim.stopped.is_set()
        assert any(a.startswith("aioq listener") for a in apps)  # LISTEN stays separate
        assert not any(a.startswith("aioq worker") for a in apps)  # no pool of its own
        # Two more workers on the same pool finish everything, the released jobs included.
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(run_until_idle, make_worker(pool=pool, concurrency=2))
        assert sorted({i for i, _ in runs}) == list(range(6))
        assert await count_jobs(conn) == 0
        assert await pool.fetchval("SELECT $1::jsonb", {"still": "open"}) == {"still": "open"}
        assert not pool.is_closing()
    assert len(ids) == 6


def test_a_worker_on_a_pool_still_needs_a_dsn_for_listen(registry: aioq.Registry) -> None:
    pool: Any = object()  # never used: the check comes first
    with pytest.raises(aioq.errors.ConfigError, match="dsn: a worker needs dsn="):
        aioq.Worker(pool=pool, registry=registry)
    with pytest.raises(aioq.errors.ConfigError, match="dsn"):
        aioq.Worker(registry=registry)
    assert aioq.Worker(pool=pool, registry=registry, listen=False).pool is pool
    listening = aioq.Worker(pool=pool, registry=registry, listen_dsn="postgresql://x/y")
    assert listening.pool is pool


# 8. Calling a task directly in a test --------------------------------------------------------


def test_job_context_lets_a_sync_task_be_called_directly(registry: aioq.Registry) -> None:
    @registry.task(name="t.sync", queue="files", max_attempts=3)
    def resize(path: str) -> str:
        job = aioq.current_job()
        return f"{path}:{job.id}:{job.attempt}/{job.max_attempts}:{job.queue}:{job.task}"

    with job_context(id=7, attempt=2, task=resize) as ctx:
        assert resize("a.png") == "a.png:7:2/3:files:t.sync"
        assert ctx.is_last_attempt is False
        with job_context(id=8, attempt=3, max_attempts=3) as inner:
            assert inner.is_last_attempt
            assert resize("b") == "b:8:3/3:default:test"
        assert resize("c") == "c:7:2/3:files:t.sync"  # the outer context is back
    with pytest.raises(aioq.AioqError) as outside:
        resize("d")
    assert str(outside.value) == (
        "current_job() called outside a running aioq task (to call a task in a test,"
        " wrap the call in aioq.testing.job_context())"
    )
    assert f"aioq.AioqError: {outside.value}" in TROUBLESHOOTING
    with pytest.raises(ValueError, match="attempt must be >= 1"), job_context(attempt=0):
        pass


async def test_job_context_reaches_async_tasks_and_worker_threads(
    registry: aioq.Registry,
) -> None:
    @registry.task(name="t.async")
    async def notify(user_id: int) -> tuple[int, int, int]:
        await anyio.lowlevel.checkpoint()
        job = aioq.current_job()
        return user_id, job.id, job.attempt

    @registry.task(name="t.thread")
    def in_thread() -> int:
        return aioq.current_job().id

    with job_context(id=42, attempt=5, max_attempts=5):
        assert await notify(1) == (1, 42, 5)
        assert await anyio.to_thread.run_sync(in_thread) == 42
    with pytest.raises(aioq.AioqError):
        await notify(1)


# Found by the hard-cancel tests above ---------------------------------------------------------


async def test_a_consumer_cancelled_while_the_handoff_closes_stops_cleanly() -> None:
    handoff = Handoff()
    waiting = anyio.Event()

    async def consume() -> None:
        waiting.set()
        await handoff.get()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await waiting.wait()
            await anyio.lowlevel.checkpoint()  # the consumer now waits on its future
            tg.cancel_scope.cancel()  # cancels that future at once...
            handoff.close()  # ...and close() drops it before the consumer wakes up
    assert await handoff.get() is None
