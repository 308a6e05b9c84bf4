"""Leases, fencing, the reaper and the LISTEN connection, against a real PostgreSQL."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import asyncpg
import pytest
import statements
from waits import eventually, until_sql

import aioq
from aioq.job import Claim, OutcomeKind
from aioq.sql.outcomes import Rescued
from aioq.worker.claims import CancelReason, Claims
from aioq.worker.completer import Completer, Outcome
from aioq.worker.consumer import Consumer
from aioq.worker.lease import Heartbeat, Reaper

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0


async def expire(conn: asyncpg.Connection, job_id: int) -> None:
    """Make a lease expire now, in database time, without waiting for it."""
    await conn.execute(
        "UPDATE aioq.jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1", job_id
    )


async def rescued_and_claimed(conn: asyncpg.Connection, job_id: int, worker_id: str) -> Claim:
    """The job's lease lapses, a reaper takes it back (pending again), and ``worker_id``
    claims it anew; return that claim."""
    await expire(conn, job_id)
    assert await Reaper(schema="aioq", db=conn, interval=1, batch_size=10).run_once() == [
        Rescued(job_id, "pending")
    ]
    [claim] = await statements.claim(conn, ["default"], 10, worker_id)
    assert claim.id == job_id
    return claim


def held(*claims: Claim) -> Claims:
    """Claims tracking these claims, as a worker's producer would."""
    tracked = Claims()
    tracked.add(claims)
    return tracked


def make_completer(conn: asyncpg.Connection, worker_id: str, claims: Claims) -> Completer:
    """A completer writing through one connection, one batch per run_once."""
    return Completer(
        schema="aioq",
        db=conn,
        worker_id=worker_id,
        claims=claims,
        keep_completed=False,
        batch_size=10,
        max_pending=10,
    )


async def test_stale_worker_is_fenced_after_rescue(
    conn: asyncpg.Connection, registry: aioq.Registry, caplog: pytest.LogCaptureFixture
) -> None:
    @registry.task
    async def work() -> None: ...

    job_id = await work.defer(conn)
    [claim_a] = await statements.claim(conn, ["default"], 10, "worker-a")
    claim_b = await rescued_and_claimed(conn, job_id, "worker-b")
    assert claim_b.attempt == claim_a.attempt + 1
    assert claim_b.number == claim_a.number + 1

    # A wakes up: its heartbeat, retry, burial and completion all change nothing.
    assert await statements.heartbeat(conn, "worker-a", [(job_id, claim_a.number)]) == set()
    assert (
        await statements.write(conn, "worker-a", [claim_a], OutcomeKind.RETRIED, error="x") == set()
    )
    assert (
        await statements.write(
            conn, "worker-a", [(job_id, claim_a.number)], OutcomeKind.DEAD, error="x"
        )
        == set()
    )
    # Even A's worker id with B's claim number is not enough, nor B's id with A's claim.
    assert (
        await statements.write(conn, "worker-a", [(job_id, claim_b.number)], OutcomeKind.SUCCEEDED)
        == set()
    )
    assert (
        await statements.write(conn, "worker-b", [(job_id, claim_a.number)], OutcomeKind.SUCCEEDED)
        == set()
    )

    claims = held(claim_a)
    completer = make_completer(conn, "worker-a", claims)
    with caplog.at_level(logging.WARNING, logger="aioq"):
        completer.put(Outcome(claim_a, OutcomeKind.SUCCEEDED))
        await completer.run_once()
    assert "lease lost" in caplog.text
    assert len(claims) == 0

    row = await conn.fetchrow(
        "SELECT status, locked_by, attempts FROM aioq.jobs WHERE id = $1", job_id
    )
    assert tuple(row) == ("running", "worker-b", claim_b.attempt)
    assert await statements.write(
        conn, "worker-b", [(job_id, claim_b.number)], OutcomeKind.SUCCEEDED
    ) == {job_id}
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0


async def test_heartbeat_reports_and_cancels_lost_leases(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def work() -> None: ...

    kept_id = await work.defer(conn)
    lost_id = await work.defer(conn)
    claims = await statements.claim(conn, ["default"], 10, "me")
    tracked = held(*claims)
    for running in tracked.held():
        running.scope = anyio.CancelScope()
    by_id = {r.claim.id: r for r in tracked.held()}
    before = await conn.fetchval("SELECT lease_expires_at FROM aioq.jobs WHERE id = $1", kept_id)
    # Another worker took lost_id over (as after a rescue and a new claim).
    await conn.execute(
        "UPDATE aioq.jobs SET locked_by = 'thief', claims = claims + 1 WHERE id = $1", lost_id
    )
    heartbeat = Heartbeat(schema="aioq", db=conn, worker_id="me", claims=tracked, interval=1)
    assert await heartbeat.run_once() == [lost_id]
    assert by_id[lost_id].cancel_reason is CancelReason.LEASE_LOST
    lost_scope = by_id[lost_id].scope
    assert lost_scope is not None
    assert lost_scope.cancel_called
    assert by_id[kept_id].cancel_reason is None
    after = await conn.fetchval("SELECT lease_expires_at FROM aioq.jobs WHERE id = $1", kept_id)
    assert after > before
    assert await conn.fetchval("SELECT locked_by FROM aioq.jobs WHERE id = $1", lost_id) == "thief"


async def test_reaper_buries_jobs_out_of_attempts(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(max_attempts=1)
    async def once() -> None: ...

    job_id = await once.defer(conn)
    await statements.claim(conn, ["default"], 10, "ghost")
    await expire(conn, job_id)
    assert await Reaper(schema="aioq", db=conn, interval=1, batch_size=10).run_once() == [
        Rescued(job_id, "dead")
    ]
    row = await conn.fetchrow(
        "SELECT status, last_error, locked_by FROM aioq.jobs WHERE id = $1", job_id
    )
    assert row["status"] == "dead"
    assert row["locked_by"] is None
    assert "LeaseExpired" in row["last_error"]
    assert "ghost" in row["last_error"]


async def test_reaper_is_bounded_per_pass(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def work() -> None: ...

    await work.defer_many(conn, [{} for _ in range(25)])
    await statements.claim(conn, ["default"], 100, "ghost")
    await conn.execute("UPDATE aioq.jobs SET lease_expires_at = now() - interval '1 second'")
    reaper = Reaper(schema="aioq", db=conn, interval=1, batch_size=10)
    assert [len(await reaper.run_once()) for _ in range(4)] == [10, 10, 5, 0]
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE status = 'pending'") == 25


async def test_heartbeat_keeps_a_job_running_three_times_its_lease(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    runs: list[int] = []

    @registry.task(lease=1.0)
    async def slow() -> None:
        runs.append(aioq.current_job().attempt)
        await anyio.sleep(3.0)  # the behaviour under test: outliving the lease thrice

    job_id = await slow.defer(conn)
    # A second worker's reaper runs often, ready to rescue anything whose lease lapses.
    async with (
        make_worker(reaper_interval=0.05, heartbeat_interval=0.1),
        make_worker(reaper_interval=0.05),
    ):
        with anyio.fail_after(30):
            await until_sql(conn, "SELECT NOT EXISTS (SELECT FROM aioq.jobs WHERE id = $1)", job_id)
    assert runs == [1]


async def test_vanished_workers_job_is_rescued_and_run(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    ran = anyio.Event()
    seen: list[tuple[int, int]] = []

    @registry.task(lease=1.0)
    async def work() -> None:
        job = aioq.current_job()
        seen.append((job.id, job.attempt))
        ran.set()

    job_id = await work.defer(conn)
    await statements.claim(conn, ["default"], 10, "vanished")  # claimed, then the worker died
    async with make_worker(reaper_interval=0.2):
        with anyio.fail_after(30):
            await ran.wait()
    assert seen == [(job_id, 2)]  # the second attempt: the vanished worker's was the first


async def test_lost_lease_cancels_local_execution(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    started, cancelled = anyio.Event(), anyio.Event()

    @registry.task(lease=5.0)
    async def hang() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    job_id = await hang.defer(conn)
    async with make_worker(heartbeat_interval=0.05):
        with anyio.fail_after(30):
            await started.wait()
            # Another worker rescued and re-claimed the job.
            await conn.execute(
                "UPDATE aioq.jobs SET locked_by = 'rescuer', claims = claims + 1 WHERE id = $1",
                job_id,
            )
            await cancelled.wait()
    row = await conn.fetchrow("SELECT status, locked_by FROM aioq.jobs WHERE id = $1", job_id)
    assert tuple(row) == ("running", "rescuer")  # the stale worker changed nothing


async def test_listener_reconnects_after_its_backend_is_killed(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    ran = anyio.Event()

    @registry.task
    async def ping() -> None:
        ran.set()

    # Polling is slow here, so a prompt pickup can only come from the doorbell.
    worker = make_worker(poll_interval=60.0)
    async with worker:
        listener = worker.current.listener
        assert listener is not None
        with anyio.fail_after(30):
            await listener.connected.wait()
            killed = await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name LIKE 'aioq listener%' AND datname = current_database()"
            )
            assert killed == 1
            await eventually(lambda: listener.connections >= 2, "the listener to reconnect")
            await listener.connected.wait()
            await ping.defer(conn)
            await ran.wait()


async def test_worker_polls_while_it_cannot_listen(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    ran = anyio.Event()

    @registry.task
    async def ping() -> None:
        ran.set()

    # Nothing listens on port 1: the LISTEN connection keeps failing, polling carries on.
    worker = make_worker(poll_interval=0.1, listen_dsn="postgresql://postgres@127.0.0.1:1/x")
    async with worker:
        await ping.defer(conn)
        with anyio.fail_after(30):
            await ran.wait()
        assert worker.current.listener is not None
        assert worker.current.listener.connections == 0


def test_retry_delay_must_be_finite_and_bounded() -> None:
    for delay in (float("inf"), float("nan"), -1.0, 1e12):
        with pytest.raises(aioq.errors.ConfigError):
            aioq.Retry(delay=delay)


@pytest.mark.parametrize("another_worker", [True, False], ids=["another worker", "alone"])
async def test_a_thread_outlives_a_hard_cancel_with_its_claim_kept_and_its_outcome_recorded(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    another_worker: bool,
) -> None:
    """docs/architecture.md, "Shutdown": Worker.run() is cancelled from outside while a plain
    def task runs in its thread. No other worker may run the job while the thread runs (its
    lease stays heartbeated), and the thread's real outcome is recorded: the job ran once."""
    lease = 1.0
    runs: list[str] = []
    started = threading.Event()
    finish = threading.Event()

    @registry.task(name="t.slow_thread", lease=lease)
    def slow() -> None:
        runs.append(aioq.current_job().worker_id)
        started.set()
        finish.wait(HANG_GUARD)

    await slow.defer(conn)
    first = make_worker(worker_id="first", concurrency=1, prefetch=0)
    cancel = anyio.CancelScope()

    async def run_first() -> None:
        with cancel:
            await first.run()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_first)
            await anyio.to_thread.run_sync(started.wait, HANG_GUARD)
            other = make_worker(worker_id="other", reaper_interval=0.1, concurrency=1)
            async with contextlib.AsyncExitStack() as stack:
                if another_worker:
                    await stack.enter_async_context(other)
                cancel.cancel()  # a hard cancel, not stop()
                # Four leases: had the claim been let go, the other reaper (every 0.1 s) would
                # have rescued the job and the other worker run it.
                await anyio.sleep(4 * lease)
                finish.set()
                await first.stopped.wait()  # the cancelled run ends once the thread returned
                assert runs == ["first"]
        # The job's real outcome: it succeeded, nothing is left to run.
        assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
        await make_worker().run_until_idle()
    assert runs == ["first"]


def rescue_once_lapsed(dsn: str, blocking: threading.Event) -> list[int]:
    """Another worker, in a thread of its own (the test's event loop is blocked once
    ``blocking`` is set): once every lease lapsed, its reaper takes the jobs back and it
    claims them; return their ids."""

    async def other() -> list[int]:
        db = await asyncpg.connect(dsn)
        try:
            await until_sql(
                db, "SELECT bool_and(lease_expires_at < now()) FROM aioq.jobs", guard=10
            )
            await Reaper(schema="aioq", db=db, interval=1, batch_size=10).run_once()
            claimed = await statements.claim(db, ["default"], 10, "other")
            return sorted(c.id for c in claimed)
        finally:
            await db.close()

    assert blocking.wait(HANG_GUARD)
    return anyio.run(other)


async def test_a_job_whose_lease_lapsed_while_it_waited_is_never_started(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    """docs/architecture.md, "Leases": jobs claimed ahead wait behind a task that blocks the
    event loop past their lease; another worker rescues them meanwhile. Once the loop is free,
    this worker must not start them (the other one owns them now)."""
    lease = 1.0
    starts: list[tuple[int, str]] = []
    blocking = threading.Event()

    @registry.task(name="t.blocker", lease=lease)
    async def blocker() -> None:
        if not blocking.is_set():
            blocking.set()
            time.sleep(3 * lease)  # noqa: ASYNC251 (the point: the event loop is blocked)

    @registry.task(name="t.ahead", lease=lease, priority=-1)
    async def ahead(n: int) -> None:
        job = aioq.current_job()
        starts.append((job.id, job.worker_id))

    await blocker.defer(conn)
    ahead_ids = await ahead.defer_many(conn, [{"n": n} for n in range(3)])

    rescued: list[int] = []
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:

            async def run_rescue() -> None:
                rescued.extend(await anyio.to_thread.run_sync(rescue_once_lapsed, dsn, blocking))

            tg.start_soon(run_rescue)
            # One consumer and three claimed ahead: the blocker runs, the others wait.
            worker = make_worker(worker_id="first", concurrency=1, prefetch=3)
            async with worker:
                # Until the other worker took them and this one has dealt with every claim
                # it held (started, given back or found lost).
                await eventually(
                    lambda: (
                        bool(rescued) and worker.current is not None and not worker.current.claims
                    ),
                    "the first worker to settle its claims",
                )
    assert set(ahead_ids) <= set(rescued)
    assert [s for s in starts if s[1] == "first"] == []


@pytest.mark.parametrize("swallows", [False, True], ids=["plain", "middleware-swallows"])
async def test_a_def_task_whose_lease_lapsed_before_its_thread_began_is_never_started(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    caplog: pytest.LogCaptureFixture,
    swallows: bool,
) -> None:
    """docs/architecture.md, "Leases": the worker decided to start a plain def task with its
    lease fresh, but the event loop was blocked (here by a middleware; in the randomized chaos
    scenario, by another task during the hand-off to the thread) before the thread began, past
    the lease; another worker rescued the job meanwhile. The thread must not call the task, and
    the run is given back as not started even when a middleware catches every exception its
    call_next raises (it would otherwise pass for a success that never ran)."""
    lease = 1.0
    starts: list[tuple[int, str]] = []
    blocking = threading.Event()

    async def block_once(job: aioq.JobContext, call_next: Callable[[], Any]) -> Any:
        if not blocking.is_set():
            blocking.set()
            time.sleep(3 * lease)  # noqa: ASYNC251 (the point: the event loop is blocked)
        if not swallows:
            return await call_next()
        try:
            return await call_next()
        except Exception:  # a catch-all error reporter, as many teams write one
            return None

    @registry.task(name="t.sync", lease=lease)
    def sync() -> None:
        job = aioq.current_job()
        starts.append((job.id, job.worker_id))

    job_id = await sync.defer(conn)

    rescued: list[int] = []
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:

            async def run_rescue() -> None:
                rescued.extend(await anyio.to_thread.run_sync(rescue_once_lapsed, dsn, blocking))

            tg.start_soon(run_rescue)
            worker = make_worker(worker_id="first", concurrency=1, middleware=[block_once])
            async with worker:
                await eventually(
                    lambda: (
                        bool(rescued) and worker.current is not None and not worker.current.claims
                    ),
                    "the first worker to settle its claim",
                )
    assert rescued == [job_id]
    assert starts == []
    assert "not started, its lease may have lapsed before its thread began" in caplog.text
    # The other worker holds it: this one gave back nothing of its (fenced).
    row = await conn.fetchrow("SELECT status, locked_by FROM aioq.jobs WHERE id = $1", job_id)
    assert tuple(row) == ("running", "other")


async def test_a_lost_claim_is_not_kept_alive_by_a_newer_claim_of_the_same_job(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    """docs/architecture.md, "Leases": a worker whose loop was blocked past a lease may hold
    two claims of one job, the old one lost (another worker's reaper took the job back) and a
    new one it claimed again since. The heartbeat extends only the new claim: the old one is
    lost, its local run cancelled, and it never passes for alive (so it is never started)."""

    @registry.task(lease=1.0)
    async def work() -> None: ...

    job_id = await work.defer(conn)
    [old] = await statements.claim(conn, ["default"], 10, "me")
    new = await rescued_and_claimed(conn, job_id, "me")
    assert (new.id, new.number) == (job_id, old.number + 1)
    tracked = held(old)
    tracked.add([new])
    stale, fresh = tracked.get(old), tracked.get(new)
    assert stale is not None
    assert fresh is not None
    stale.scope = anyio.CancelScope()
    long_ago = time.monotonic() - 10.0
    stale.extended_at = fresh.extended_at = long_ago
    heartbeat = Heartbeat(schema="aioq", db=conn, worker_id="me", claims=tracked, interval=1)
    assert await heartbeat.run_once() == [job_id]
    assert stale.cancel_reason is CancelReason.LEASE_LOST
    assert stale.scope.cancel_called
    assert stale.lapsed(time.monotonic())  # not extended: it would never be started
    assert fresh.cancel_reason is None
    assert fresh.extended_at > long_ago
    # Both claims were held in the one statement: the row's lease was extended for the new one.
    row = await conn.fetchrow(
        "SELECT locked_by, claims, lease_expires_at > now() AS alive FROM aioq.jobs WHERE id = $1",
        job_id,
    )
    assert tuple(row) == ("me", new.number, True)


async def test_a_job_claimed_again_waits_for_its_lost_run_on_the_same_worker(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    """docs/architecture.md, "Leases": a worker's loop was blocked past a job's lease while a
    thread ran the job; another worker's reaper took it back, and this worker claimed it again.
    The earlier claim is lost at once (cancelled, never heartbeated), and the new run starts
    only once the thread of the lost one returned: one worker never runs a job twice at once."""
    events: list[tuple[str, int]] = []
    release = threading.Event()
    first_started = threading.Event()
    second_started = threading.Event()

    @registry.task(name="t.threaded", lease=10.0)  # expired by hand below; no heartbeat here
    def threaded() -> None:
        attempt = aioq.current_job().attempt
        events.append(("start", attempt))
        if attempt == 1:
            first_started.set()
            release.wait(HANG_GUARD)
        else:
            second_started.set()
        events.append(("end", attempt))

    job_id = await threaded.defer(conn)
    claims = Claims()
    completer = make_completer(conn, "me", claims)
    consumer = Consumer(
        registry=registry,
        worker_id="me",
        claims=claims,
        completer=completer,
        stopping=anyio.Event(),
        threads=anyio.CapacityLimiter(4),
    )
    [old] = await statements.claim(conn, ["default"], 10, "me")
    claims.add([old])
    lost = claims.get(old)
    assert lost is not None
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer.handle, old)
            await anyio.to_thread.run_sync(first_started.wait, HANG_GUARD)
            try:
                # Its lease lapses (no heartbeat here), another worker's reaper takes it back.
                new = await rescued_and_claimed(conn, job_id, "me")
                claims.add([new])
                tg.start_soon(consumer.handle, new)
                # While the lost run's thread goes on, the new claim is not started.
                assert not await anyio.to_thread.run_sync(second_started.wait, 1.0)
                assert events == [("start", 1)]
            finally:
                release.set()
    assert events == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert lost.cancel_reason is CancelReason.LEASE_LOST
    # The new claim's outcome went to the completer; the lost one's was dropped.
    await completer.run_once()
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
