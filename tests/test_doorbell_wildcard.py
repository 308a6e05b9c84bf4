"""The doorbell's bound (docs/architecture.md, "The doorbell"): a worker arms its queues one by
one up to MAX_ARMED of them, and the wildcard ("any queue") beyond, so its LISTEN session holds
at most 2 * MAX_ARMED advisory locks whatever the number of queues; a failed arm warns, leaves
no lock behind, and the worker polls.

Every test polls at most once a minute: a prompt pickup can only come from a ring.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable

import anyio
import asyncpg
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from waits import eventually

import aioq
import aioq.doorbell
from aioq.doorbell import MAX_ARMED

pytestmark = pytest.mark.anyio

SLOW_POLL = 60.0
HANG_GUARD = 30.0

# Advisory locks held by aioq LISTEN sessions of this database, by mode: standby locks are
# shared (ShareLock), a duty lock exclusive (ExclusiveLock).
LISTENER_LOCKS = """
SELECT l.mode, count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted
  AND a.datname = current_database() AND a.application_name LIKE 'aioq listener %'
GROUP BY l.mode
"""

# The most advisory locks any one aioq LISTEN session of this database holds.
MOST_PER_SESSION = """
SELECT coalesce(max(n), 0) FROM (
    SELECT count(*) AS n FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory'
      AND a.datname = current_database() AND a.application_name LIKE 'aioq listener %'
    GROUP BY l.pid) AS per_session
"""

STANDBY_KEY = "hashtextextended($1, ~'aioq.jobs'::regclass::oid::bigint)"


async def locks(conn: asyncpg.Connection) -> tuple[int, int]:
    """(standby locks, duty locks) held by the workers' LISTEN sessions."""
    held = dict(await conn.fetch(LISTENER_LOCKS))
    return held.get("ShareLock", 0), held.get("ExclusiveLock", 0)


async def _asleep(conn: asyncpg.Connection, workers: int = 1) -> bool:
    """``workers`` idle workers, one on duty: a standby lock each, one duty lock."""
    return await locks(conn) == (workers, 1)


async def _unarmed(conn: asyncpg.Connection) -> bool:
    return await locks(conn) == (0, 0)


async def _gone(conn: asyncpg.Connection, job_id: int) -> bool:
    return await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE id = $1", job_id) == 0


class Spy:
    """Every payload on the default schema's doorbell channel. Its sentinel goes on a channel
    of its own (notifications of one session arrive in order whatever their channel): on the
    doorbell's, a worker armed on the wildcard would take it for a queue it does not watch."""

    def __init__(self) -> None:
        self._send: MemoryObjectSendStream[str]
        self._receive: MemoryObjectReceiveStream[str]
        self._send, self._receive = anyio.create_memory_object_stream[str](math.inf)

    def on_notify(self, conn: object, pid: int, channel: str, payload: str) -> None:
        self._send.send_nowait(payload)

    def close(self) -> None:
        self._send.close()
        self._receive.close()

    async def until_sentinel(self, sender: asyncpg.Connection) -> list[str]:
        """What arrived before a sentinel sent now (notifications arrive in order)."""
        await sender.execute("SELECT pg_notify('spy', 'sentinel')")
        seen: list[str] = []
        with anyio.fail_after(HANG_GUARD):
            async for payload in self._receive:
                if payload == "sentinel":
                    return seen
                seen.append(payload)
        raise AssertionError("the notification stream closed")  # pragma: no cover


@pytest.fixture
async def spy(dsn: str) -> AsyncIterator[Spy]:
    conn = await asyncpg.connect(dsn)
    spy = Spy()
    await conn.add_listener("aioq:aioq", spy.on_notify)
    await conn.add_listener("spy", spy.on_notify)
    try:
        yield spy
    finally:
        await conn.close()
        spy.close()


async def test_a_worker_serving_6000_queues_holds_two_locks_and_is_rung_for_each(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """Two locks per queue would be 12 000 for this worker alone: more than the whole lock
    table of a server with the default settings ("out of shared memory" for every new
    connection of every database). Armed on the wildcard it holds two, and a defer into any of
    its queues rings it."""
    queues = [f"tenant-{n}" for n in range(6000)]
    ran: list[str] = []

    @registry.task
    async def job() -> None:
        ran.append(aioq.current_job().queue)

    async with make_worker(poll_interval=SLOW_POLL, queues=queues) as worker:
        assert worker.current is not None
        assert worker.current.listener is not None
        for n, queue in enumerate(["tenant-0", "tenant-2999", "tenant-5999", "tenant-4242"]):
            await eventually(lambda: _asleep(conn), "the worker to arm the wildcard")
            assert await conn.fetchval(MOST_PER_SESSION) <= 2 * MAX_ARMED
            await job.options(queue=queue).defer(conn)
            with anyio.fail_after(HANG_GUARD):
                await eventually(lambda n=n: len(ran) > n, f"the job on {queue}", every=0.01)
        assert ran == ["tenant-0", "tenant-2999", "tenant-5999", "tenant-4242"]
        assert worker.current.listener.arms >= 4


@pytest.mark.parametrize("queue", ["elsewhere", "paused"])
async def test_a_wildcard_rung_for_a_queue_it_does_not_watch_pauses_instead_of_ringing_on(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
    monkeypatch: pytest.MonkeyPatch,
    queue: str,
) -> None:
    """Armed on the wildcard, a worker is rung by an insert into any queue: one it does not
    serve, or one of its own it cannot claim from (paused). That ring ends its duty, and it
    arms the wildcard again only after a pause (here longer than the test), so the queue's
    later inserts ring nobody: one notification per pause, not one per commit (a NOTIFY per
    commit would serialize the commits)."""
    monkeypatch.setattr(aioq.doorbell, "FIRST_PAUSE", SLOW_POLL)

    @registry.task
    async def job() -> None: ...

    await aioq.admin.set_queue(conn, "paused", paused=True)
    # More claimable queues than it arms one by one (the paused one is not claimable).
    queues = [f"q{n}" for n in range(MAX_ARMED + 1)] + ["paused"]
    async with make_worker(poll_interval=SLOW_POLL, queues=queues):
        await eventually(lambda: _asleep(conn), "the worker to arm the wildcard")
        assert await conn.fetchval(MOST_PER_SESSION) == 2
        await spy.until_sentinel(conn)
        await job.options(queue=queue).defer(conn)
        assert await spy.until_sentinel(conn) == [queue]
        await eventually(lambda: _unarmed(conn), "the worker to leave the wildcard's duty")
        for _ in range(20):
            await job.options(queue=queue).defer(conn)  # one transaction each
        assert await spy.until_sentinel(conn) == []


async def test_after_its_pause_the_wildcard_is_armed_again(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
) -> None:
    """A ring for a queue it does not serve, then the pause (the first is short): the worker
    arms the wildcard again by itself, and a defer into one of its queues rings it."""
    ran: list[str] = []

    @registry.task
    async def job() -> None:
        ran.append(aioq.current_job().queue)

    queues = [f"q{n}" for n in range(MAX_ARMED + 1)]
    async with make_worker(poll_interval=SLOW_POLL, queues=queues) as worker:
        assert worker.current is not None
        assert worker.current.listener is not None
        listener = worker.current.listener
        await eventually(lambda: _asleep(conn), "the worker to arm the wildcard")
        arms = listener.arms
        await job.options(queue="elsewhere").defer(conn)
        await eventually(lambda: listener.arms > arms, "the wildcard to be armed again")
        await eventually(lambda: _asleep(conn), "the worker to sleep on it")
        await job.options(queue="q7").defer(conn)
        with anyio.fail_after(HANG_GUARD):
            await eventually(lambda: ran == ["q7"], "the job on q7 (before a poll)", every=0.01)


@pytest.mark.parametrize("stop", ["graceful", "hard cancel"])
async def test_the_wildcard_is_handed_over_to_a_worker_of_other_queues(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    stop: str,
) -> None:
    """Two wide workers of different queues: one on duty for the wildcard, the other asleep on
    its watch (every insert rings while someone holds the wildcard). The one on duty stops: it
    rings the wildcard's key on the hand-over channel, and the other takes duty."""
    ran: list[str] = []

    @registry.task(lease=1.0)
    async def job() -> None:
        ran.append(aioq.current_job().queue)

    sets = [[f"{side}{n}" for n in range(MAX_ARMED + 1)] for side in "ab"]
    workers = [make_worker(poll_interval=SLOW_POLL, queues=q, heartbeat_interval=0.3) for q in sets]
    async with anyio.create_task_group() as tg:
        scopes = [anyio.CancelScope() for _ in workers]

        async def run(w: aioq.Worker, scope: anyio.CancelScope) -> None:
            with scope:
                await w.run()

        for w, scope in zip(workers, scopes, strict=True):
            tg.start_soon(run, w, scope)
        await eventually(lambda: _asleep(conn, workers=2), "one on duty, one asleep", HANG_GUARD)
        assert await conn.fetchval(MOST_PER_SESSION) == 2
        duty = await conn.fetchval(
            """
            SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
            WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted
              AND a.datname = current_database() AND a.application_name LIKE 'aioq listener %'
            """
        )
        duty_id = duty.removeprefix("aioq listener ")[:40]
        first = next(k for k, w in enumerate(workers) if w.id.startswith(duty_id))
        if stop == "graceful":
            workers[first].stop()
        else:
            scopes[first].cancel()
        await eventually(lambda: _asleep(conn), "the other worker to take the duty", HANG_GUARD)
        queue = sets[1 - first][5]
        job_id = await job.options(queue=queue).defer(conn)
        await eventually(lambda: _gone(conn, job_id), "the job to run (before a poll)", HANG_GUARD)
        assert ran == [queue]
        workers[1 - first].stop()


async def test_workers_armed_one_by_one_and_on_the_wildcard_racing_inserts_miss_nothing(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    """A fleet of both kinds on one queue, short leases, inserts committing a moment after
    they ran: the wildcard's probes of the queue's key (taken exclusively for an instant) never
    leave a worker armed one by one asleep without a duty holder, and no job waits for a poll."""
    ran: list[int] = []

    @registry.task(lease=1.0, queue="q")
    async def job(n: int) -> None:
        ran.append(n)

    async def defer_in_transactions(inserter: asyncpg.Connection, first: int) -> None:
        for n in range(first, first + 25):
            async with inserter.transaction():
                await job.defer(inserter, n=n)
                await anyio.sleep(0.002 * (n % 3))  # commit a moment after the insert ran
            await anyio.sleep(0.002 * (n % 2))

    wide = ["q", *(f"filler{n}" for n in range(MAX_ARMED))]
    workers = [
        make_worker(poll_interval=SLOW_POLL, queues=queues, concurrency=2, heartbeat_interval=0.3)
        for queues in (["q"], wide, ["q"], wide)
    ]
    inserters = [await asyncpg.connect(dsn) for _ in range(4)]
    try:
        async with workers[0], workers[1], workers[2], workers[3]:
            await eventually(lambda: _standby(conn, 4), "the workers to arm the doorbell")
            async with anyio.create_task_group() as tg:
                for k, inserter in enumerate(inserters):
                    tg.start_soon(defer_in_transactions, inserter, 100 * k)
            await eventually(lambda: len(ran) >= 100, "every job to run", HANG_GUARD)
            assert await conn.fetchval(MOST_PER_SESSION) <= 2
        assert sorted(ran) == [n for k in range(4) for n in range(100 * k, 100 * k + 25)]
        assert await locks(conn) == (0, 0)
    finally:
        for inserter in inserters:
            await inserter.close()


async def _standby(conn: asyncpg.Connection, n: int) -> bool:
    return (await locks(conn))[0] == n


async def test_a_failed_arm_warns_leaves_no_lock_and_the_worker_polls(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An arm statement that fails midway (here cancelled while it waits for the second
    queue's standby key; out of shared memory fails the same way) has taken locks that a
    rollback does not release (advisory locks are the session's): they are released, a
    warning says so, and the worker polls. Once it can, it arms again."""
    ran: list[str] = []

    @registry.task
    async def job() -> None:
        ran.append(aioq.current_job().queue)

    blocker = await asyncpg.connect(dsn)
    key = await blocker.fetchval(f"SELECT {STANDBY_KEY}", "b")
    await blocker.execute("SELECT pg_advisory_lock($1)", key)
    try:
        with caplog.at_level(logging.INFO, logger="aioq"):
            async with make_worker(poll_interval=SLOW_POLL, queues=["a", "b"]) as worker:
                assert worker.current is not None
                assert worker.current.listener is not None
                waiting = """
                    SELECT l.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                    WHERE l.locktype = 'advisory' AND NOT l.granted
                      AND a.datname = current_database()
                      AND a.application_name LIKE 'aioq listener %'
                """
                pid = await eventually(lambda: conn.fetchval(waiting), "the arm to wait")
                assert await locks(conn) == (1, 0)  # a's standby, taken before it waited
                assert await conn.fetchval("SELECT pg_cancel_backend($1)", pid)
                await eventually(lambda: "arming the doorbell failed" in caplog.text, "the warning")
                [failed] = [r for r in caplog.records if "arming the doorbell" in r.message]
                assert failed.levelno == logging.WARNING
                assert "polling meanwhile" in failed.message
                await eventually(lambda: _unarmed(conn), "the locks of the failed arm to go")
                await blocker.execute("SELECT pg_advisory_unlock($1)", key)
                # Any ring (here a plain one) wakes the producer: it claims, and arms again.
                await conn.execute("SELECT pg_notify('aioq:aioq', 'a')")
                await eventually(lambda: _both_armed(conn), "both queues armed")
                assert "the doorbell is armed again" in caplog.text
                job_id = await job.options(queue="b").defer(conn)
                await eventually(lambda: _gone(conn, job_id), "the job (before a poll)", 20)
    finally:
        await blocker.close()


async def _both_armed(conn: asyncpg.Connection) -> bool:
    return await locks(conn) == (2, 2)
