"""The core's promises on the paths a review found broken, each against a real PostgreSQL.

Short leases on healthy workers, hard cancellation, tasks raising BaseException, threads that
overstay, a blocked event loop, a poison outcome, and the lock order of concurrent writes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import asyncpg
import pytest
import statements
from faults import pool_with_fault
from waits import eventually, until_sql

import aioq
from aioq.options import MIN_LEASE
from aioq.sql.jobs import CLAIM_ONE_QUEUE
from aioq.worker.producer import Producer

pytestmark = pytest.mark.anyio

MakeWorker = Callable[..., aioq.Worker]
HANG_GUARD = 60.0
NO_BACKOFF = aioq.Backoff(base=0, max=0, jitter=0)


async def rows(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return await conn.fetch("SELECT * FROM aioq.jobs ORDER BY id")  # type: ignore[no-any-return]


# 10.1 -- any lease the API accepts holds on a healthy worker ---------------------------------


async def test_short_leases_hold_whatever_the_heartbeat_interval(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    runs: Counter[int] = Counter()

    @registry.task(name="t.long", lease=MIN_LEASE)
    async def long() -> None:
        runs[aioq.current_job().id] += 1
        await anyio.sleep(3.5 * MIN_LEASE)  # outlives its lease three times over

    ids = await long.defer_many(conn, [{} for _ in range(4)])
    # The default 5 s heartbeat: the claims arrive while it sleeps. An eager reaper in a
    # worker of another queue runs the whole time: a lease that lapsed would come back to
    # pending, and the runner would run its job again.
    rescuer = make_worker(queues=["elsewhere"], reaper_interval=0.1)
    with anyio.fail_after(HANG_GUARD):
        async with rescuer:
            await make_worker(reaper_interval=0.1).run_until_idle()
    assert runs == Counter(ids), "each job ran exactly once"


def test_leases_below_the_floor_are_refused(registry: aioq.Registry) -> None:
    with pytest.raises(aioq.errors.ConfigError, match="lease"):

        @registry.task(lease=MIN_LEASE / 2)
        async def short() -> None: ...

    @registry.task(name="t.ok")
    async def ok() -> None: ...

    with pytest.raises(aioq.errors.ConfigError, match="lease"):
        ok.options(lease=0.1)


# 10.4 -- cancelling Worker.run() from outside ------------------------------------------------


async def test_cancelling_run_from_outside_is_plain_cancellation(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    running = 0
    all_started = anyio.Event()

    @registry.task(name="t.busy", max_attempts=1)
    async def busy() -> None:
        nonlocal running
        running += 1
        if running == 2:
            all_started.set()
        await anyio.sleep(60)

    for _ in range(5):
        running, all_started = 0, anyio.Event()
        # Two jobs, six consumers: four wait for claims when the cancel comes.
        await busy.defer_many(conn, [{} for _ in range(2)])
        worker = make_worker(concurrency=6)
        task = asyncio.get_running_loop().create_task(worker.run())
        with anyio.fail_after(HANG_GUARD):
            await all_started.wait()
            # After its next pass the producer waits for the doorbell: the consumers, the
            # producer and the handoff's waiters all get the cancel at once.
            await worker.service(Producer).passed.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Nothing is left running, and nothing burned its only attempt.
        assert {(r["status"], r["attempts"]) for r in await rows(conn)} == {("pending", 0)}
        await conn.execute("DELETE FROM aioq.jobs")


async def test_a_cancel_scope_and_a_raising_async_with_body_propagate_unwrapped(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="t.wait")
    async def wait() -> None:
        await anyio.sleep(60)

    await wait.defer_many(conn, [{} for _ in range(10)])
    for _ in range(3):
        with anyio.move_on_after(0.5) as scope:
            await make_worker(concurrency=3).run()
        assert scope.cancelled_caught

    async def fail_inside() -> None:
        async with make_worker(concurrency=3):
            # 3 running (and, with prefetch=N, N more claimed ahead)
            await until_sql(conn, "SELECT count(*) >= 3 FROM aioq.jobs WHERE status = 'running'")
            raise KeyError("the caller's own")

    for _ in range(3):
        with pytest.raises(KeyError, match="the caller's own"):  # not an ExceptionGroup
            await fail_inside()
    assert {r["status"] for r in await rows(conn)} == {"pending"}


async def test_a_claim_whose_reply_was_never_seen_is_released_on_stop(
    conn: asyncpg.Connection, dsn: str, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="t.never", max_attempts=1)
    async def never() -> None: ...

    claimed = anyio.Event()

    async def hang(args: Sequence[object], rows: list[Any]) -> None:
        """The first claim commits, then hangs as if its reply never came."""
        if rows and not claimed.is_set():
            claimed.set()
            await anyio.sleep_forever()

    await never.defer_many(conn, [{} for _ in range(5)])
    async with pool_with_fault(dsn, CLAIM_ONE_QUEUE, hang) as pool:
        worker = make_worker(pool=pool)
        with anyio.fail_after(HANG_GUARD), anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.run)
                await claimed.wait()
                scope.cancel()
    assert [(r["status"], r["attempts"], r["locked_by"]) for r in await rows(conn)] == [
        ("pending", 0, None)
    ] * 5


# 10.3 -- a task raising SystemExit or KeyboardInterrupt ------------------------------------


async def test_base_exceptions_from_tasks_fail_like_any_other(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    done: list[int] = []

    @registry.task(name="t.exit", max_attempts=2, retry=NO_BACKOFF)
    async def exits() -> None:
        raise SystemExit(3)

    @registry.task(name="t.interrupt", max_attempts=2, retry=NO_BACKOFF)
    async def interrupts() -> None:
        raise KeyboardInterrupt

    @registry.task(name="t.thread_exit", max_attempts=2, retry=NO_BACKOFF)
    def thread_exits() -> None:
        raise SystemExit("from a thread")

    @registry.task(name="t.fine")
    async def fine(n: int) -> None:
        await anyio.sleep(0.05)
        done.append(n)

    bad = [await exits.defer(conn), await interrupts.defer(conn), await thread_exits.defer(conn)]
    await fine.defer_many(conn, [{"n": n} for n in range(10)])  # claimed in the same batch
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()
    assert sorted(done) == list(range(10))
    dead = await rows(conn)
    assert [r["id"] for r in dead] == bad
    assert [(r["status"], r["attempts"]) for r in dead] == [("dead", 2)] * 3
    assert [r["last_error"].split(":")[0] for r in dead] == [
        "SystemExit",
        "KeyboardInterrupt",
        "SystemExit",
    ]


# 10.5 -- a plain def task that overstays its timeout or the grace --------------------------


async def test_a_thread_past_its_timeout_keeps_its_claim_until_it_returns(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    lock = threading.Lock()
    active, overlapped, runs = 0, False, 0

    @registry.task(
        name="t.stubborn", timeout=0.2, lease=MIN_LEASE, max_attempts=3, retry=NO_BACKOFF
    )
    def stubborn() -> None:
        nonlocal active, overlapped, runs
        with lock:
            runs += 1
            active += 1
            overlapped |= active > 1
        time.sleep(1.5 * MIN_LEASE)  # past the timeout and the lease: the heartbeat keeps it
        with lock:
            active -= 1

    job_id = await stubborn.defer(conn)
    with anyio.fail_after(HANG_GUARD):
        await make_worker(reaper_interval=0.1).run_until_idle()
    assert runs == 3
    assert not overlapped
    row = await conn.fetchrow("SELECT * FROM aioq.jobs WHERE id = $1", job_id)
    assert row["status"] == "dead"
    assert row["last_error"].startswith("TimeoutError")


async def test_shutdown_waits_for_a_thread_and_records_its_outcome(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    started = threading.Event()
    finished: list[int] = []

    @registry.task(name="t.slow_thread", lease=MIN_LEASE)
    def slow_thread() -> None:
        started.set()
        time.sleep(2.0 * MIN_LEASE)
        finished.append(1)

    await slow_thread.defer(conn)
    with caplog.at_level(logging.WARNING, logger="aioq"):
        async with make_worker(shutdown_grace=0.1):
            with anyio.fail_after(HANG_GUARD):
                await eventually(started.is_set, "the thread to start")
    assert finished == [1]  # the worker stopped only after the thread returned
    assert "cannot be interrupted" in caplog.text
    assert await rows(conn) == []  # its outcome was recorded: done, not released


# 10.11 -- a task that blocks the event loop --------------------------------------------------


async def test_a_blocked_loop_is_reported_and_never_makes_a_worker_rescue_itself(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []

    @registry.task(name="t.blocker", lease=MIN_LEASE)
    async def blocker() -> None:
        runs.append(aioq.current_job().attempt)
        time.sleep(2.5 * MIN_LEASE)  # noqa: ASYNC251 (the behaviour under test)

    await blocker.defer(conn)
    with caplog.at_level(logging.WARNING, logger="aioq"), anyio.fail_after(HANG_GUARD):
        await make_worker(reaper_interval=0.05, lag_threshold=0.5).run_until_idle()
    assert runs == [1]
    assert await rows(conn) == []
    assert "event loop blocked" in caplog.text
    assert "t.blocker" in caplog.text


# 10.9 -- one poison outcome must not wedge the completer ---------------------------------


async def test_an_outcome_that_cannot_be_archived_does_not_wedge_the_completer(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @registry.task(name="t.done")
    async def done() -> None: ...

    ids = await done.defer_many(conn, [{} for _ in range(5)])
    # An archive row already holds one job's id: archiving that job can never succeed.
    await conn.execute(
        "INSERT INTO aioq.archive (id, queue, task, args, priority, attempts, max_attempts,"
        " created_at, started_at) VALUES ($1, 'x', 'x', '{}', 0, 1, 1, now(), now())",
        ids[2],
    )
    with caplog.at_level(logging.ERROR, logger="aioq"), anyio.fail_after(HANG_GUARD):
        await make_worker(keep_completed=True).run_until_idle()
    assert await rows(conn) == []
    archived = await conn.fetch("SELECT id, task FROM aioq.archive ORDER BY id")
    assert [(r["id"], r["task"]) for r in archived] == [
        (i, "x" if i == ids[2] else "t.done") for i in ids
    ]
    assert f"job {ids[2]} t.done: its archive row cannot be stored" in caplog.text


# 10.10 -- the heartbeat, the completer and the reaper lock rows in one order ---------------


async def test_no_deadlock_between_heartbeat_and_completer_at_concurrency_200(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @registry.task(name="t.quick")
    async def quick(n: int) -> None:
        await anyio.sleep((n * 7919 % 23) / 1000)  # finish in an order unlike the claim's

    await quick.defer_many(conn, [{"n": n} for n in range(8000)])
    with caplog.at_level(logging.ERROR, logger="aioq"), anyio.fail_after(HANG_GUARD):
        await make_worker(
            concurrency=200, heartbeat_interval=0.002, completion_batch=50
        ).run_until_idle()
    assert await rows(conn) == []
    assert "deadlock" not in caplog.text.lower()


async def test_a_worker_releases_its_own_orphans_after_a_lost_claim_reply(
    conn: asyncpg.Connection, dsn: str, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    ran: list[int] = []
    lost: list[int] = []

    @registry.task(name="t.orphan", max_attempts=1)
    async def orphan(n: int) -> None:
        ran.append(n)

    async def lose(args: Sequence[object], rows: list[Any]) -> None:
        """The first claim commits, then fails as if the connection dropped."""
        if rows and not lost:
            lost.append(len(rows))
            raise ConnectionResetError("connection lost before the reply (injected)")

    await orphan.defer_many(conn, [{"n": n} for n in range(5)])
    async with pool_with_fault(dsn, CLAIM_ONE_QUEUE, lose) as pool:
        # Alone: no other worker's reaper would rescue its orphans.
        with anyio.fail_after(HANG_GUARD):
            await make_worker(pool=pool).run_until_idle()
    assert lost
    assert sorted(ran) == list(range(5))  # each ran once, its only attempt not burned
    assert await rows(conn) == []


async def test_a_worker_releases_what_a_previous_process_with_its_id_left_running(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    ran: list[int] = []

    @registry.task(name="t.left", max_attempts=1)
    async def left(n: int) -> None:
        ran.append(n)

    await left.defer_many(conn, [{"n": n} for n in range(3)])
    await statements.claim(conn, ["default"], 10, "worker-1")  # then it died
    # Its own reaper leaves worker-1's claims alone; the 30 s leases are not waited for.
    with anyio.fail_after(10):
        await make_worker(worker_id="worker-1").run_until_idle()
    assert sorted(ran) == [0, 1, 2]
    assert await rows(conn) == []
