"""The conditional doorbell (docs/architecture.md, "The doorbell"): inserts ring only for queues a worker sleeps on.

A worker about to sleep arms the doorbell (shared advisory locks on its LISTEN connection) and
looks for jobs once more; the first ring disarms it. Every test here polls at most once a
minute, so a prompt pickup can only come from a ring.
"""

from __future__ import annotations

import math
import random
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import anyio
import asyncpg
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from procs import spawner
from waits import eventually

import aioq
import aioq.doorbell
from aioq.worker.producer import Producer

pytestmark = pytest.mark.anyio

SLOW_POLL = 60.0  # seconds: longer than any wait below, so polling cannot explain a pickup
HANG_GUARD = 30.0

# Doorbell locks held by aioq LISTEN connections of this database (one per armed queue).
ARMED = """
SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.mode = 'ShareLock' AND l.granted
  AND a.datname = current_database() AND a.application_name LIKE 'aioq listener %'
"""


# An advisory lock's 64-bit key as pg_locks shows it (its two halves), and a name's standby key.
KEY = "(l.classid::bigint << 32 | l.objid::bigint)"
STANDBY_KEY = "hashtextextended($1, ~'aioq.jobs'::regclass::oid::bigint)"


async def armed(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval(ARMED))


async def gone(conn: asyncpg.Connection, job_id: int) -> bool:
    return await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE id = $1", job_id) == 0


class Spy:
    """Every notification on the default schema's channel, from a plain (unarmed) LISTEN."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self._send: MemoryObjectSendStream[str]
        self._receive: MemoryObjectReceiveStream[str]
        self._send, self._receive = anyio.create_memory_object_stream[str](math.inf)

    def on_notify(self, conn: object, pid: int, channel: str, payload: str) -> None:
        self._send.send_nowait(payload)

    def close(self) -> None:
        self._send.close()
        self._receive.close()

    async def until_sentinel(self, sender: asyncpg.Connection) -> list[str]:
        """Return what arrived before a sentinel sent now (notifications arrive in order)."""
        await sender.execute("SELECT pg_notify('aioq:aioq', 'sentinel')")
        seen: list[str] = []
        with anyio.fail_after(HANG_GUARD):
            async for payload in self._receive:
                if payload == "sentinel":
                    return seen
                seen.append(payload)
        raise AssertionError("the notification stream closed")  # pragma: no cover


@pytest.fixture(params=["one by one", "wildcard"])
def arming(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How workers arm their queues: one by one (few queues), or through the wildcard (more
    than MAX_ARMED: here every worker, its bound set to 0)."""
    if request.param == "wildcard":
        monkeypatch.setattr(aioq.doorbell, "MAX_ARMED", 0)
    return str(request.param)


@pytest.fixture
async def spy(dsn: str) -> AsyncIterator[Spy]:
    conn = await asyncpg.connect(dsn)
    spy = Spy(conn)
    await conn.add_listener("aioq:aioq", spy.on_notify)
    try:
        yield spy
    finally:
        await conn.close()
        spy.close()


async def test_a_sleeping_worker_is_woken_by_each_commit(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
) -> None:
    ran: list[int] = []

    @registry.task
    async def ping(n: int) -> None:
        ran.append(n)

    async with make_worker(poll_interval=SLOW_POLL) as worker:
        assert worker.current.listener is not None
        for n in range(3):
            await eventually(lambda: _armed_once(conn), "the worker to arm the doorbell")
            await ping.defer(conn, n=n)
            with anyio.fail_after(HANG_GUARD):
                await eventually(lambda n=n: len(ran) > n, f"job {n} to run", every=0.01)
        # One ring per sleep: each commit rang once, and the worker re-armed after each.
        assert await spy.until_sentinel(conn) == ["default"] * 3
        assert worker.current.listener.arms >= 3


async def _armed_once(conn: asyncpg.Connection) -> bool:
    """One worker asleep: its standby lock and its duty lock. The standby alone is taken first,
    in the same statement: an insert seen then could still find nobody on duty (in flight)."""
    return await armed(conn) == 1 and len(await _on_duty(conn)) == 1


async def test_a_busy_worker_is_not_rung(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
) -> None:
    started: list[int] = []
    release = anyio.Event()

    @registry.task
    async def hold(n: int) -> None:
        started.append(n)
        await release.wait()

    # No claiming ahead: with both consumers busy, the worker has no free slot at all.
    async with make_worker(poll_interval=SLOW_POLL, concurrency=2, prefetch=0):
        await eventually(lambda: _armed_once(conn), "the worker to arm the doorbell")
        first = [await hold.defer(conn, n=n) for n in range(2)]
        with anyio.fail_after(HANG_GUARD):
            await eventually(lambda: len(started) >= 2, "both jobs to start", every=0.01)
        # Every slot is busy. The worker may have re-armed between its claims: one more
        # insert rings at most once and disarms it; after that nothing rings.
        backlog = [await hold.defer(conn, n=2)]
        await eventually(lambda: _disarmed(conn), "the worker to disarm the doorbell")
        await spy.until_sentinel(conn)
        for n in range(3, 53):
            backlog.append(await hold.defer(conn, n=n))  # one transaction each
        assert await spy.until_sentinel(conn) == []
        release.set()
        for job_id in first + backlog:
            await eventually(lambda job_id=job_id: gone(conn, job_id), "the backlog to drain")  # type: ignore[misc]


async def _disarmed(conn: asyncpg.Connection) -> bool:
    return await armed(conn) == 0


async def test_a_rolled_back_defer_rings_nothing_and_keeps_the_worker_armed(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
) -> None:
    ran = anyio.Event()

    @registry.task
    async def ping() -> None:
        ran.set()

    async with make_worker(poll_interval=SLOW_POLL):
        await eventually(lambda: _armed_once(conn), "the worker to arm the doorbell")
        tx = conn.transaction()
        await tx.start()
        await ping.defer(conn)
        await ping.defer_many(conn, [{}, {}])
        await tx.rollback()
        assert await spy.until_sentinel(conn) == []
        assert await armed(conn) == 1  # still waiting for a ring
        await ping.defer(conn)
        with anyio.fail_after(HANG_GUARD):
            await ran.wait()
        assert await spy.until_sentinel(conn) == ["default"]


async def test_workers_are_rung_for_the_queues_they_sleep_on(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
) -> None:
    ran: dict[str, list[str]] = {"a": [], "b": []}

    @registry.task
    async def where(queue: str) -> None:
        job = aioq.current_job()
        ran[queue].append(job.worker_id)

    only_a = make_worker(poll_interval=SLOW_POLL, queues=["a"])
    both = make_worker(poll_interval=SLOW_POLL, queues=["a", "b"])
    async with only_a, both:
        # One lock per armed queue: a, and a and b.
        await eventually(lambda: _armed_count(conn, 3), "both workers to arm the doorbell")
        await where.options(queue="b").defer(conn, queue="b")
        await eventually(lambda: _ran(ran["b"], 1), "the job on b")
        assert ran["b"] == [both.id]
        # Neither worker ever polls here: each job on a is found through a ring.
        for n in range(1, 6):
            await eventually(lambda: _armed_any(conn, "a"), "a worker to sleep on a")
            await where.options(queue="a").defer(conn, queue="a")
            await eventually(lambda n=n: _ran(ran["a"], n), "the job on a")  # type: ignore[misc]
        # A queue nobody serves never rings.
        await where.options(queue="c").defer(conn, queue="c")
        assert "c" not in await spy.until_sentinel(conn)


async def _armed_count(conn: asyncpg.Connection, n: int) -> bool:
    return await armed(conn) == n


async def _armed_any(conn: asyncpg.Connection, queue: str) -> bool:
    held = await conn.fetchval(ARMED + f" AND {KEY} = {STANDBY_KEY}", queue)
    return bool(held)


async def _ran(items: list[str], n: int) -> bool:
    return len(items) >= n


TASKS = """
import aioq

registry = aioq.Registry()


@registry.task(name="noop")
async def noop() -> None:
    pass
"""


@pytest.fixture
def worker_process(dsn: str, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    (tmp_path / "doorbelltasks.py").write_text(TASKS)
    with spawner(dsn) as spawn:
        yield lambda *args: spawn(
            "worker", "doorbelltasks:registry", *args, cwd=tmp_path, output=subprocess.DEVNULL
        )


async def test_worker_processes_are_rung(
    conn: asyncpg.Connection, worker_process: Callable[..., subprocess.Popen[str]]
) -> None:
    worker_process("--processes", "2", "--poll-interval", str(SLOW_POLL))
    await eventually(lambda: _armed_count(conn, 2), "both processes to arm the doorbell")
    noop = aioq.Registry().task(name="noop")(_noop)
    for _ in range(4):
        await eventually(lambda: _armed_any(conn, "default"), "a process to sleep on the queue")
        job_id = await noop.defer(conn)
        await eventually(lambda job_id=job_id: gone(conn, job_id), "the job to run")  # type: ignore[misc]


async def _noop() -> None: ...


async def test_a_killed_worker_stops_the_ringing(
    conn: asyncpg.Connection, worker_process: Callable[..., subprocess.Popen[str]], spy: Spy
) -> None:
    proc = worker_process("--poll-interval", str(SLOW_POLL))
    await eventually(lambda: _armed_once(conn), "the process to arm the doorbell")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Its backend ends with its socket, and the lock with the session: nothing rings any more.
    await eventually(lambda: _disarmed(conn), "the server to drop the dead worker's locks")
    noop = aioq.Registry().task(name="noop")(_noop)
    for _ in range(5):
        await noop.defer(conn)
    assert await spy.until_sentinel(conn) == []


async def test_a_defer_in_flight_while_the_worker_arms_is_started_at_its_commit(
    arming: str,
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
) -> None:
    """The lost wake-up: a transaction inserts while the worker is awake (nobody waits, so its
    insert does not ring), the worker then arms and looks once more (the row is not committed,
    it sees nothing), and only then does the transaction commit."""
    release = anyio.Event()
    started: list[str] = []

    @registry.task
    async def job(name: str) -> None:
        started.append(name)
        if name == "first":
            await release.wait()

    other = await asyncpg.connect(dsn)
    # One slot and no claiming ahead: while the first job runs, the worker does not arm.
    async with make_worker(poll_interval=SLOW_POLL, concurrency=1, prefetch=0) as worker:
        producer = worker.service(Producer)
        await eventually(lambda: _armed_once(conn), "the worker to arm the doorbell")
        await job.defer(conn, name="first")  # rings, and the ring disarms the doorbell
        with anyio.fail_after(HANG_GUARD):
            await eventually(lambda: started == ["first"], "the first job to start", every=0.01)
        await eventually(lambda: _disarmed(conn), "the worker to disarm the doorbell")
        tx = other.transaction()
        await tx.start()
        second = await job.defer(other, name="second")  # nobody is armed: no ring
        passes = producer.passed.count
        release.set()
        # The slot frees: a pass finds nothing (the row is not committed), the worker arms,
        # and a pass looks once more and finds nothing either.
        await eventually(lambda: producer.passed.count >= passes + 2, "two more passes")
        assert await armed(conn) == 1
        await tx.commit()
        # The poll is a minute away (SLOW_POLL): only the doorbell can explain a start now.
        await eventually(
            lambda: gone(conn, second), "the second job to run (before the poll)", HANG_GUARD
        )
        assert started == ["first", "second"]
        # The first defer rang; the second could not (nobody was armed when it inserted).
        assert await spy.until_sentinel(conn) == ["default"]
    await other.close()


async def test_inserts_racing_the_arms_of_several_workers_are_never_left_for_the_poll(
    arming: str,
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
) -> None:
    """Several workers with short leases arm and look again while inserts commit a moment
    after their insert ran: every job starts long before a poll could find it."""
    ran: list[int] = []

    @registry.task(lease=1.0)
    async def job(n: int) -> None:
        ran.append(n)

    async def defer_in_transactions(inserter: asyncpg.Connection, first: int) -> None:
        for n in range(first, first + 25):
            async with inserter.transaction():
                await job.defer(inserter, n=n)
                # Commit a moment after the insert ran: the race with a worker's arm.
                await anyio.sleep(random.uniform(0, 0.004))
            await anyio.sleep(random.uniform(0, 0.004))

    inserters = [await asyncpg.connect(dsn) for _ in range(4)]
    workers = [
        make_worker(poll_interval=SLOW_POLL, concurrency=2, heartbeat_interval=0.3)
        for _ in range(3)
    ]
    try:
        async with workers[0], workers[1], workers[2]:
            await eventually(lambda: _armed_count(conn, 3), "the workers to arm the doorbell")
            async with anyio.create_task_group() as tg:
                for k, inserter in enumerate(inserters):
                    tg.start_soon(defer_in_transactions, inserter, 100 * k)
            # No poll comes within the guard: a job left unrung would fail this.
            await eventually(lambda: len(ran) >= 100, "every job to run", HANG_GUARD)
            await eventually(lambda: _armed_count(conn, 3), "the idle workers to re-arm")
        assert sorted(ran) == [n for k in range(4) for n in range(100 * k, 100 * k + 25)]
        assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
        # Stopped workers leave no lock behind: nothing rings any more.
        assert await armed(conn) == 0
        await spy.until_sentinel(conn)
        await job.defer(conn, n=-1)
        assert await spy.until_sentinel(conn) == []
    finally:
        for inserter in inserters:
            await inserter.close()


async def test_a_worker_cancelled_while_looking_again_leaves_no_lock_and_loses_no_job(
    arming: str,
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
) -> None:
    ran: list[str] = []

    @registry.task(lease=1.0)
    async def job(name: str) -> None:
        ran.append(name)

    other = await asyncpg.connect(dsn)
    tx = other.transaction()
    await tx.start()
    in_flight = await job.defer(other, name="in flight")  # nobody armed: no ring
    doomed = make_worker(poll_interval=SLOW_POLL)
    async with anyio.create_task_group() as tg:
        tg.start_soon(doomed.run)
        await eventually(
            lambda: (
                doomed.current is not None
                and doomed.current.listener is not None
                and doomed.current.listener.arms == 1
            )
        )
        # The insert is in flight: the worker keeps looking again instead of sleeping.
        passes = doomed.service(Producer).passed.count
        await eventually(lambda: doomed.service(Producer).passed.count > passes + 2)
        tg.cancel_scope.cancel()  # a hard cancel, mid-pause
    # Its LISTEN session closed, and its locks went with it.
    await eventually(lambda: _disarmed(conn), "the cancelled worker's locks to go")
    await spy.until_sentinel(conn)
    await job.defer(conn, name="unheard")
    assert await spy.until_sentinel(conn) == []  # nobody rings for a worker that is gone
    async with make_worker(poll_interval=SLOW_POLL):
        await tx.commit()
        await eventually(
            lambda: gone(conn, in_flight), "the job to run (before the poll)", HANG_GUARD
        )
        await eventually(lambda: len(ran) == 2, "both jobs to run", HANG_GUARD)
    assert sorted(ran) == ["in flight", "unheard"]
    await other.close()


# The worker on duty for a queue holds its key exclusively; the others sleep on standby.
ON_DUTY = """
SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted
  AND a.datname = current_database() AND a.application_name LIKE 'aioq listener %'
"""


async def _on_duty(conn: asyncpg.Connection) -> list[str]:
    return [r[0].removeprefix("aioq listener ") for r in await conn.fetch(ON_DUTY)]


async def _one_on_duty_and_the_other_standing_by(conn: asyncpg.Connection) -> bool:
    return len(await _on_duty(conn)) == 1 and await armed(conn) == 2


@pytest.mark.parametrize("stop", ["graceful", "hard cancel"])
async def test_the_worker_on_duty_hands_over_when_it_stops(
    arming: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    stop: str,
) -> None:
    """Two idle workers: one on duty, the other asleep on its watch. The one on duty stops (or
    is cancelled hard): it rings the other, which takes over, so a job deferred afterwards
    starts long before a poll."""
    ran: list[str] = []

    @registry.task(lease=1.0)
    async def job() -> None:
        ran.append(aioq.current_job().worker_id)

    workers = [make_worker(poll_interval=SLOW_POLL, heartbeat_interval=0.3) for _ in range(2)]
    async with anyio.create_task_group() as outer:
        scopes = []
        for w in workers:
            scope = anyio.CancelScope()
            scopes.append(scope)

            async def run(w: aioq.Worker = w, scope: anyio.CancelScope = scope) -> None:
                with scope:
                    await w.run()

            outer.start_soon(run)
        # One on duty (exclusive), both asleep (a standby lock each: ShareLock).
        await eventually(
            lambda: _one_on_duty_and_the_other_standing_by(conn), "one worker on duty", HANG_GUARD
        )
        [duty_id] = await _on_duty(conn)
        first = next(k for k, w in enumerate(workers) if w.id.startswith(duty_id[:40]))
        if stop == "graceful":
            workers[first].stop()
        else:
            scopes[first].cancel()
        other = workers[1 - first]
        await eventually(
            lambda: _on_duty_is(conn, other.id), "the other worker to take duty", HANG_GUARD
        )
        job_id = await job.defer(conn)
        await eventually(lambda: gone(conn, job_id), "the job to run (before a poll)", HANG_GUARD)
        assert ran == [other.id]
        other.stop()


async def _on_duty_is(conn: asyncpg.Connection, worker_id: str) -> bool:
    held = await _on_duty(conn)
    return len(held) == 1 and worker_id.startswith(held[0])


# An advisory lock the worker's LISTEN session waits for.
WAITING = """
SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND NOT l.granted
  AND a.datname = current_database() AND a.application_name LIKE 'aioq listener %'
"""


async def _arm_waits(conn: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval(WAITING))


async def test_a_ring_that_arrives_while_the_worker_arms_disarms_it_all_the_same(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    spy: Spy,
) -> None:
    """A notification that reaches the LISTEN session while its arm statement runs is read
    before that statement's reply: PostgreSQL sends it ahead of ReadyForQuery, so the ring is
    heard while the worker is still arming. It must disarm the doorbell all the same; else the
    worker stays on duty while it works, and every insert rings for nothing.

    The order is driven by a lock: the worker's arm waits for the standby key this test holds,
    the job and the ring come meanwhile, then the key is released."""
    release = anyio.Event()
    started: list[int] = []

    @registry.task
    async def hold(n: int) -> None:
        started.append(n)
        await release.wait()

    blocker = await asyncpg.connect(dsn)
    key = await blocker.fetchval(f"SELECT {STANDBY_KEY}", "default")
    await blocker.execute("SELECT pg_advisory_lock($1)", key)
    try:
        async with make_worker(poll_interval=SLOW_POLL, concurrency=1, prefetch=0):
            await eventually(lambda: _arm_waits(conn), "the worker's arm to wait for the key")
            await hold.defer(conn, n=0)  # nobody is on duty: no ring
            await conn.execute("SELECT pg_notify('aioq:aioq', 'default')")  # rung, while arming
            await blocker.execute("SELECT pg_advisory_unlock($1)", key)
            with anyio.fail_after(HANG_GUARD):
                await eventually(lambda: started == [0], "the job to start", every=0.01)
            # Rung while it armed: it leaves duty, as after any ring.
            await eventually(lambda: _disarmed(conn), "the worker to disarm", HANG_GUARD)
            await spy.until_sentinel(conn)
            await hold.defer(conn, n=1)  # the worker is busy: nothing rings
            assert await spy.until_sentinel(conn) == []
            release.set()
            with anyio.fail_after(HANG_GUARD):
                await eventually(lambda: started == [0, 1], "the second job", every=0.01)
    finally:
        await blocker.close()


# Two queue names whose 32-bit hashtext() is the same, found by brute force:
#   SELECT h, array_agg(name) FROM (
#       SELECT 'tenant-' || i AS name, hashtext('tenant-' || i) AS h
#       FROM generate_series(1, 300000) AS i) AS t
#   GROUP BY h HAVING count(*) > 1;
# Their doorbell keys were (the jobs table's oid, hashtext(queue)): one key for both.
COLLIDING = ("tenant-45849", "tenant-97803")


async def test_two_queues_whose_hashtext_collide_each_have_their_doorbell(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """A worker on each of two colliding queues: the second would find the first on duty for
    the shared key and sleep on its watch, and the first, when it stops, hands over the name
    of its own queue: nobody would be on duty for the second's, and its jobs would wait for the
    poll."""
    a, b = COLLIDING
    assert await conn.fetchval("SELECT hashtext($1) = hashtext($2)", a, b)
    assert await conn.fetchval("SELECT aioq.doorbell_key($1) <> aioq.doorbell_key($2)", a, b)
    ran: list[str] = []

    @registry.task
    async def job() -> None:
        ran.append(aioq.current_job().queue)

    first = make_worker(poll_interval=SLOW_POLL, queues=[a])
    second = make_worker(poll_interval=SLOW_POLL, queues=[b])
    first_done = anyio.Event()

    async def run_first() -> None:
        await first.run()
        first_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_first)
        await eventually(lambda: _armed_once(conn), "the first worker to sleep on its queue")
        tg.start_soon(second.run)
        await eventually(lambda: _armed_count(conn, 2), "the second worker to sleep too")
        await eventually(lambda: _arms(second) == 1, "the second worker's arm to end")
        first.stop()
        with anyio.fail_after(HANG_GUARD):
            await first_done.wait()
        job_id = await job.options(queue=b).defer(conn)
        await eventually(lambda: gone(conn, job_id), "the job on b to run (before a poll)", 20)
        assert ran == [b]
        second.stop()


def _arms(worker: aioq.Worker) -> int:
    return (
        0
        if worker.current is None or worker.current.listener is None
        else worker.current.listener.arms
    )
