"""The worker against a real PostgreSQL: draining, retries, bad input, timeouts, shutdown."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel
import asyncpg
import pytest
from waits import eventually, until_sql

import aioq

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0
MakeWorker = Callable[..., aioq.Worker]
QUICK = aioq.Backoff(base=0.05, factor=2, max=1, jitter=0)


@pytest.fixture
async def probe(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A second connection, for tasks to read the database while the test uses ``conn``."""
    connection = await asyncpg.connect(dsn)
    yield connection
    await connection.close()


async def job_row(conn: asyncpg.Connection, job_id: int) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT * FROM aioq.jobs WHERE id = $1", job_id)


async def status_of(conn: asyncpg.Connection, job_id: int) -> str | None:
    return await conn.fetchval("SELECT status FROM aioq.jobs WHERE id = $1", job_id)  # type: ignore[no-any-return]


async def count_rows(conn: asyncpg.Connection, where: str = "true") -> int:
    return await conn.fetchval(f"SELECT count(*) FROM aioq.jobs WHERE {where}")  # type: ignore[no-any-return]


async def run_until_idle(worker: aioq.Worker) -> None:
    with anyio.fail_after(HANG_GUARD):
        await worker.run_until_idle()


# 1 ------------------------------------------------------------------------------------------


async def test_two_workers_drain_5000_jobs_exactly_once(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    runs: Counter[int] = Counter()
    by_worker: Counter[str] = Counter()

    @registry.task(name="t.count")
    async def count(n: int) -> None:
        job = aioq.current_job()
        runs[job.id] += 1
        by_worker[job.worker_id] += 1
        await anyio.lowlevel.checkpoint()

    ids = await count.defer_many(conn, [{"n": i} for i in range(5000)])
    workers = [make_worker(concurrency=20), make_worker(concurrency=20)]
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(worker.run_until_idle)

    assert len(ids) == 5000
    assert runs == Counter(ids), "every job runs exactly once"
    assert await count_rows(conn) == 0
    assert set(by_worker) == {w.id for w in workers}, by_worker
    assert sum(by_worker.values()) == 5000


# 2 ------------------------------------------------------------------------------------------


async def test_failures_back_off_then_die_and_replay(
    conn: asyncpg.Connection,
    probe: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
) -> None:
    failing = True
    seen: list[tuple[int, asyncpg.Record]] = []  # (attempt, the row as the attempt saw it)

    @registry.task(name="t.boom", max_attempts=3, retry=QUICK)
    async def boom() -> None:
        job = aioq.current_job()
        row = await job_row(probe, job.id)
        assert row is not None
        seen.append((job.attempt, row))
        if failing:
            raise ValueError("boom")

    job_id = await boom.defer(conn)
    async with make_worker():
        await eventually(lambda: _is(conn, job_id, "dead"))

    assert [attempt for attempt, _ in seen] == [1, 2, 3]
    assert [row["attempts"] for _, row in seen] == [1, 2, 3]
    assert seen[0][1]["last_error"] is None
    assert "ValueError: boom" in seen[1][1]["last_error"]
    # Each failure sets run_at = (DB time of the failure, after the claim) + base * factor**(k-1);
    # the next attempt reads that run_at. So run_at grows by at least the backoff each time.
    run_ats = [row["run_at"] for _, row in seen]
    assert run_ats == sorted(run_ats)
    assert len(set(run_ats)) == 3
    for k in (1, 2):
        claimed_at = seen[k - 1][1]["locked_at"]
        assert run_ats[k] >= claimed_at + timedelta(seconds=0.05 * 2 ** (k - 1))

    dead = await job_row(conn, job_id)
    assert dead is not None
    assert dead["status"] == "dead"
    assert dead["attempts"] == 3
    assert dead["locked_by"] is None
    assert dead["lease_expires_at"] is None
    assert dead["last_error"].startswith("ValueError: boom")
    assert "Traceback (most recent call last)" in dead["last_error"]
    assert 'raise ValueError("boom")' in dead["last_error"]

    # A dead job is never claimed.
    await run_until_idle(make_worker())
    assert len(seen) == 3
    assert await status_of(conn, job_id) == "dead"

    # Replay: pending again with fresh attempts, and it runs.
    failing = False
    assert (await aioq.admin.replay(conn, job_id=job_id)).replayed == [job_id]
    replayed = await job_row(conn, job_id)
    assert replayed is not None
    assert (replayed["status"], replayed["attempts"]) == ("pending", 0)
    await run_until_idle(make_worker())
    assert [attempt for attempt, _ in seen] == [1, 2, 3, 1]
    assert await job_row(conn, job_id) is None


async def _is(conn: asyncpg.Connection, job_id: int, status: str) -> bool:
    return await status_of(conn, job_id) == status


async def test_retry_dead_by_task_and_by_queue_replays_only_matching_jobs(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    failing = True
    ran: list[int] = []

    @registry.task(name="t.a")
    async def a() -> None:
        if failing:
            raise aioq.Fail("down")
        ran.append(aioq.current_job().id)

    @registry.task(name="t.b")
    async def b() -> None:
        if failing:
            raise aioq.Fail("down")
        ran.append(aioq.current_job().id)

    a1 = await a.options(queue="q1").defer(conn)
    a2 = await a.options(queue="q2").defer(conn)
    b1 = await b.options(queue="q1").defer(conn)
    b2 = await b.options(queue="q2").defer(conn)
    await run_until_idle(make_worker(queues=["q1", "q2"]))
    assert await count_rows(conn, "status = 'dead'") == 4

    failing = False
    assert (await aioq.admin.replay(conn, task="t.a")).replayed == sorted([a1, a2])
    await run_until_idle(make_worker(queues=["q1", "q2"]))
    assert sorted(ran) == sorted([a1, a2])

    assert (await aioq.admin.replay(conn, queue="q2")).replayed == [b2]
    await run_until_idle(make_worker(queues=["q1", "q2"]))
    assert sorted(ran) == sorted([a1, a2, b2])

    left = await conn.fetch("SELECT id, status FROM aioq.jobs")
    assert [(r["id"], r["status"]) for r in left] == [(b1, "dead")]


# 3 ------------------------------------------------------------------------------------------


async def test_bad_rows_die_with_clear_errors_and_the_worker_keeps_serving(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    ran: list[int] = []
    ran_event = anyio.Event()

    @registry.task(name="t.good")
    async def good(n: int = 0) -> None:
        nonlocal ran_event
        ran.append(n)
        ran_event.set()

    async def insert(task: str, args: str) -> int:
        return await conn.fetchval(  # type: ignore[no-any-return]
            "INSERT INTO aioq.jobs (task, args, max_attempts) VALUES ($1, $2::jsonb, 1) RETURNING id",
            task,
            args,
        )

    unknown = await insert("no.such.task", "{}")
    not_object = await insert("t.good", "[1, 2]")
    not_binding = await insert("t.good", '{"wrong": 1}')
    fine = await good.defer(conn, n=1)

    async with make_worker():
        with anyio.fail_after(HANG_GUARD):
            await ran_event.wait()
        bad = (not_object, not_binding)
        await eventually(lambda: _all_dead(conn, bad))
        # A task this worker does not know: its job waits for a worker that knows it,
        # unspent (docs/architecture.md, "Unknown tasks").
        await until_sql(
            conn,
            "SELECT status = 'pending' AND attempts = 0 AND unknown_since IS NOT NULL"
            " FROM aioq.jobs WHERE id = $1",
            unknown,
        )

        errors = {
            r["id"]: r["last_error"]
            for r in await conn.fetch(
                "SELECT id, last_error FROM aioq.jobs WHERE id = ANY($1)", bad
            )
        }
        assert errors[not_object].startswith("PayloadError: ")
        assert "'t.good'" in errors[not_object]
        assert "JSON object" in errors[not_object]
        assert errors[not_binding].startswith("PayloadError: ")
        assert "'t.good'" in errors[not_binding]
        assert "'wrong'" in errors[not_binding]
        # Outcomes of one batch are written one statement per kind: the completion may land
        # just after the burials.
        assert await eventually(lambda: _gone(conn, fine))

        # Still serving.
        ran_event = anyio.Event()
        later = await good.defer(conn, n=2)
        with anyio.fail_after(HANG_GUARD):
            await ran_event.wait()
        await eventually(lambda: _gone(conn, later))
    assert ran == [1, 2]


async def _gone(conn: asyncpg.Connection, job_id: int) -> bool:
    return await job_row(conn, job_id) is None


async def _all_dead(conn: asyncpg.Connection, ids: tuple[int, ...]) -> bool:
    n = await conn.fetchval(
        "SELECT count(*) FROM aioq.jobs WHERE id = ANY($1) AND status = 'dead'", list(ids)
    )
    return bool(n == len(ids))


async def _gone(conn: asyncpg.Connection, job_id: int) -> bool:
    return await job_row(conn, job_id) is None


class BrokenStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


async def raise_with_nul() -> None:
    raise ValueError("bad\x00byte")


async def raise_with_surrogate() -> None:
    raise ValueError("file \udc80.txt")  # what surrogateescape makes of a non-UTF-8 name


async def raise_broken_str() -> None:
    raise BrokenStr


async def raise_foreign_cancelled() -> None:
    future = asyncio.get_running_loop().create_future()
    future.cancel()  # cancelled by someone else: awaiting it raises CancelledError
    await future


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            raise_with_nul,
            "ValueError: bad\\x00byte",
            id="nul-in-message",
        ),
        pytest.param(
            raise_with_surrogate,
            "ValueError: file \\udc80.txt",
            id="lone-surrogate",
        ),
        pytest.param(
            raise_broken_str,
            "BrokenStr: ",
            id="broken-str",
        ),
        pytest.param(
            raise_foreign_cancelled,
            "CancelledError",
            id="foreign-cancelled-error",
        ),
    ],
)
async def test_a_task_failing_oddly_dies_and_the_worker_keeps_serving(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
    caplog: pytest.LogCaptureFixture,
    body: Callable[[], Awaitable[None]],
    expected: str,
) -> None:
    after = anyio.Event()
    registry.task(name="t.odd", max_attempts=1)(body)

    @registry.task(name="t.after")
    async def ok() -> None:
        after.set()

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

    async def settled() -> bool:
        # Dead, or stuck: an outcome that cannot be written, or a worker that stopped.
        return await _is(conn, job_id, "dead") or bool(errors()) or worker.stopped.is_set()

    job_id = await conn.fetchval(
        "INSERT INTO aioq.jobs (task, max_attempts) VALUES ('t.odd', 1) RETURNING id"
    )
    worker = make_worker()
    async with worker:
        await eventually(settled)
        assert not worker.stopped.is_set(), "the worker stopped serving"
        assert errors() == []
        row = await job_row(conn, job_id)
        assert row is not None
        assert row["status"] == "dead"
        assert expected in row["last_error"]
        await ok.defer(conn)
        with anyio.fail_after(HANG_GUARD):
            await after.wait()


# 4 ------------------------------------------------------------------------------------------


async def test_a_hanging_task_times_out_and_follows_the_retry_policy(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    never = anyio.Event()
    attempts: list[int] = []

    @registry.task(name="t.hang", timeout=0.2, max_attempts=2, retry=QUICK)
    async def hang() -> None:
        attempts.append(aioq.current_job().attempt)
        await never.wait()

    job_id = await hang.defer(conn)
    async with make_worker():
        await eventually(lambda: _is(conn, job_id, "dead"))
    assert attempts == [1, 2]
    row = await job_row(conn, job_id)
    assert row is not None
    assert row["last_error"].startswith("TimeoutError: ")
    assert "timed out" in row["last_error"]
    assert "'t.hang'" in row["last_error"]


# 5 ------------------------------------------------------------------------------------------


async def test_a_sync_task_runs_in_a_thread_and_sees_its_job(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    seen: list[tuple[int, int, int]] = []

    @registry.task(name="t.sync")
    def blocking(x: int) -> None:
        seen.append((threading.get_ident(), aioq.current_job().id, x))

    job_id = await blocking.defer(conn, x=7)
    await run_until_idle(make_worker())
    assert len(seen) == 1
    thread, seen_id, x = seen[0]
    assert thread != threading.get_ident()
    assert (seen_id, x) == (job_id, 7)
    assert await job_row(conn, job_id) is None


# 6 ------------------------------------------------------------------------------------------


async def test_retry_requested_by_the_task_does_not_spend_the_failure_budget(
    conn: asyncpg.Connection,
    probe: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
) -> None:
    runs: list[tuple[int, asyncpg.Record]] = []
    done = anyio.Event()

    @registry.task(name="t.snooze", max_attempts=1)
    async def snooze() -> None:
        job = aioq.current_job()
        row = await job_row(probe, job.id)
        assert row is not None
        runs.append((job.attempt, row))
        if len(runs) == 1:
            raise aioq.Retry(delay=0.05)
        done.set()

    job_id = await snooze.defer(conn)
    async with make_worker():
        with anyio.fail_after(HANG_GUARD):
            await done.wait()
        await eventually(lambda: _gone(conn, job_id))
    # Even with max_attempts=1 the job ran twice: a requested retry is not a failure. The
    # snooze counts as a run and adds one to max_attempts (as in Oban).
    assert [attempt for attempt, _ in runs] == [1, 2]
    second = runs[1][1]
    assert (second["attempts"], second["max_attempts"], second["snoozes"]) == (2, 2, 1)
    assert second["last_error"] is None
    assert second["run_at"] > runs[0][1]["run_at"]


async def test_fail_raised_by_the_task_kills_the_job_at_once(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    runs: list[int] = []

    @registry.task(name="t.fail", max_attempts=5)
    async def fail() -> None:
        runs.append(aioq.current_job().attempt)
        raise aioq.Fail("nope")

    job_id = await fail.defer(conn)
    await run_until_idle(make_worker())
    assert runs == [1]
    row = await job_row(conn, job_id)
    assert row is not None
    assert (row["status"], row["attempts"]) == ("dead", 1)
    assert row["last_error"].startswith("Fail: nope")


# 7 ------------------------------------------------------------------------------------------


async def test_higher_priority_first_then_fifo(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    order: list[str] = []

    @registry.task(name="t.p")
    async def p(label: str) -> None:
        order.append(label)

    await p.options(priority=0).defer(conn, label="p0")
    await p.options(priority=10).defer(conn, label="p10")
    await p.options(priority=5).defer(conn, label="p5")
    # Equal priority and equal run_at (one transaction): id order.
    async with conn.transaction():
        for label in ("e1", "e2", "e3"):
            await p.options(priority=3).defer(conn, label=label)
    # Equal priority, deferred one after the other: FIFO.
    await p.options(priority=3).defer_many(conn, [{"label": "f1"}, {"label": "f2"}])

    await run_until_idle(make_worker(concurrency=1, claim_batch=1))
    assert order == ["p10", "p5", "e1", "e2", "e3", "f1", "f2", "p0"]


# 8 ------------------------------------------------------------------------------------------


async def test_a_delayed_job_does_not_run_before_run_at(
    conn: asyncpg.Connection,
    probe: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
) -> None:
    started: list[Any] = []

    @registry.task(name="t.later")
    async def later() -> None:
        started.append(await probe.fetchval("SELECT clock_timestamp()"))

    job_id = await later.options(delay=1.0).defer(conn)
    row = await job_row(conn, job_id)
    assert row is not None
    run_at = row["run_at"]
    assert run_at > row["created_at"]

    await run_until_idle(make_worker())
    still_early = await conn.fetchval("SELECT clock_timestamp() < $1", run_at)
    if still_early:  # otherwise the machine was too slow for this check to mean anything
        assert started == []
        assert await status_of(conn, job_id) == "pending"

    async with make_worker():
        await eventually(lambda: _gone(conn, job_id))
    assert len(started) == 1
    assert started[0] >= run_at


# 9 ------------------------------------------------------------------------------------------


async def test_shutdown_lets_a_running_job_finish_within_grace(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    entered, release = anyio.Event(), anyio.Event()
    finished: list[int] = []

    @registry.task(name="t.long")
    async def long() -> None:
        entered.set()
        await release.wait()
        finished.append(aioq.current_job().id)

    job_id = await long.defer(conn)
    worker = make_worker(shutdown_grace=5.0)
    with anyio.fail_after(HANG_GUARD):
        async with worker:
            await entered.wait()
            worker.stop()
            release.set()
    assert worker.stopped.is_set()
    assert finished == [job_id]
    assert await job_row(conn, job_id) is None
    assert await count_rows(conn, "status = 'running'") == 0


async def test_shutdown_releases_a_job_that_outlives_the_grace(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    entered, never = anyio.Event(), anyio.Event()

    @registry.task(name="t.stuck")
    async def stuck() -> None:
        entered.set()
        await never.wait()

    job_id = await stuck.defer(conn)
    worker = make_worker(shutdown_grace=0.3)
    with anyio.fail_after(HANG_GUARD):
        async with worker:
            await entered.wait()
            row = await job_row(conn, job_id)
            assert row is not None
            assert (row["status"], row["attempts"], row["locked_by"]) == ("running", 1, worker.id)
    row = await job_row(conn, job_id)
    assert row is not None
    assert row["status"] == "pending"
    assert row["attempts"] == 0, "a release on shutdown does not burn an attempt"
    assert row["locked_by"] is None
    assert row["lease_expires_at"] is None
    assert row["last_error"] is None
    assert await count_rows(conn, "status = 'running'") == 0


# 10 -----------------------------------------------------------------------------------------


async def test_run_until_idle_returns_once_nothing_is_ready(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    ran: list[int] = []

    @registry.task(name="t.n")
    async def n(i: int) -> None:
        ran.append(i)

    await run_until_idle(make_worker())  # empty queue

    await n.defer_many(conn, [{"i": i} for i in range(30)])
    future = await n.options(delay=3600).defer(conn, i=-1)
    await run_until_idle(make_worker(concurrency=4))
    assert sorted(ran) == list(range(30))
    remaining = await conn.fetch("SELECT id, status FROM aioq.jobs")
    assert [(r["id"], r["status"]) for r in remaining] == [(future, "pending")]


async def test_async_with_serves_jobs_deferred_after_entering(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    done = anyio.Event()

    @registry.task(name="t.ping")
    async def ping() -> None:
        done.set()

    worker = make_worker()
    with anyio.fail_after(HANG_GUARD):
        async with worker:
            job_id = await ping.defer(conn)
            await done.wait()
            await eventually(lambda: _gone(conn, job_id))
    assert worker.stopped.is_set()
    assert await count_rows(conn) == 0


# 11 -----------------------------------------------------------------------------------------


async def test_keep_completed_archives_finished_jobs(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="t.kept")
    async def kept(i: int) -> None:
        pass

    ids = await kept.defer_many(conn, [{"i": i} for i in range(3)])
    worker = make_worker(keep_completed=True)
    await run_until_idle(worker)
    assert await count_rows(conn) == 0
    archived = await conn.fetch("SELECT * FROM aioq.archive ORDER BY id")
    assert [r["id"] for r in archived] == ids
    for r in archived:
        assert r["task"] == "t.kept"
        assert r["attempts"] == 1
        assert r["worker"] == worker.id
        assert r["finished_at"] is not None
        assert r["finished_at"] >= r["started_at"]
    assert sorted(r["args"] for r in archived) == sorted(f'{{"i": {i}}}' for i in range(3))

    # By default a finished job is deleted, not archived.
    dropped = await kept.defer(conn, i=9)
    await run_until_idle(make_worker())
    assert await job_row(conn, dropped) is None
    assert await conn.fetchval("SELECT count(*) FROM aioq.archive WHERE id = $1", dropped) == 0


# 12 -----------------------------------------------------------------------------------------


def test_current_job_outside_a_task_raises() -> None:
    with pytest.raises(aioq.AioqError, match="outside"):
        aioq.current_job()
