"""The consumer on its own: one claim through ``handle``/``run_one``, its outcome written by a
real completer into a real PostgreSQL (the same paths through a whole worker: test_worker.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import anyio
import asyncpg
import pytest
import statements

import aioq
from aioq.job import Claim, OutcomeKind
from aioq.worker.claimer import Claimer
from aioq.worker.claims import CancelReason, Claims, Running
from aioq.worker.completer import Completer
from aioq.worker.consumer import Consumer

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0
QUICK = aioq.Backoff(base=7, factor=2, max=100, jitter=0)  # delays the tests can recognise


@dataclasses.dataclass
class Rig:
    """A consumer wired as a worker wires it: shared claims, a completer, a thread limiter."""

    conn: asyncpg.Connection
    claims: Claims
    completer: Completer
    consumer: Consumer
    stopping: anyio.Event

    async def claim(self, n: int = 1) -> list[Claim]:
        claimed = await statements.claim(self.conn, ["default"], n, "me")
        self.claims.add(claimed)
        return claimed

    def running(self, claim: Claim) -> Running:
        running = self.claims.get(claim)
        assert running is not None
        return running

    async def handle(self, *claims: Claim) -> None:
        """Run each claim and write its outcome."""
        for claim in claims:
            await self.consumer.handle(claim)
        await self.completer.flush()

    async def row(self, job_id: int) -> asyncpg.Record | None:
        return await self.conn.fetchrow(
            "SELECT status, attempts, last_error, locked_by, run_at > now() AS later"
            " FROM aioq.jobs WHERE id = $1",
            job_id,
        )


@pytest.fixture
def rig(conn: asyncpg.Connection, registry: aioq.Registry) -> Rig:
    claims = Claims()
    completer = Completer(
        schema="aioq",
        db=conn,
        worker_id="me",
        claims=claims,
        keep_completed=False,
        batch_size=100,
        max_pending=100,
    )
    stopping = anyio.Event()
    consumer = Consumer(
        registry=registry,
        worker_id="me",
        claims=claims,
        threads=anyio.CapacityLimiter(2),
        stopping=stopping,
        completer=completer,
    )
    return Rig(conn, claims, completer, consumer, stopping)


async def insert(conn: asyncpg.Connection, task: str, args: str, max_attempts: int) -> int:
    return await conn.fetchval(  # type: ignore[no-any-return]
        "INSERT INTO aioq.jobs (task, args, max_attempts) VALUES ($1, $2::jsonb, $3) RETURNING id",
        task,
        args,
        max_attempts,
    )


async def test_an_unknown_task_is_handed_on_unspent_skipped_then_dead_after_the_grace(
    rig: Rig,
) -> None:
    # Another worker may know the task (a rolling deploy): handed on, its attempt refunded.
    claimer = Claimer(
        schema="aioq",
        db=rig.conn,
        queues=["default"],
        worker_id="me",
        ring=lambda: None,
        unknown_task_grace=3600,
    )
    rig.consumer.unknown = claimer
    job_id = await insert(rig.conn, "no.such.task", "{}", 2)
    [first] = await rig.claim()
    assert first.unknown_for is None
    await rig.handle(first)
    row = await rig.conn.fetchrow(
        "SELECT status, attempts, claims, last_error, run_at <= now() AS ready,"
        " unknown_since IS NOT NULL AS marked FROM aioq.jobs WHERE id = $1",
        job_id,
    )
    assert tuple(row) == ("pending", 0, 1, None, True, True)
    assert list(claimer.unknown) == ["no.such.task"]
    # This worker's claims leave it to a worker that knows its task; another worker's do not.
    assert await claimer.claim(10) == []
    [again] = await statements.claim(rig.conn, ["default"], 10, "other")
    assert again.unknown_for is not None
    assert again.unknown_for >= 0
    await rig.conn.execute(
        "UPDATE aioq.jobs SET status = 'pending', locked_by = NULL, lease_expires_at = NULL,"
        " attempts = 0, unknown_since = now() - interval '2 hours' WHERE id = $1",
        job_id,
    )
    # Past this worker's grace: its claim takes the job, to make it dead.
    [late] = await claimer.claim(10)
    rig.claims.add([late])
    await rig.handle(late)
    row = await rig.conn.fetchrow("SELECT status, attempts, last_error FROM aioq.jobs")
    assert (row["status"], row["attempts"]) == ("dead", 1)
    assert row["last_error"] == (
        "UnknownTaskError: no task named 'no.such.task' is registered in the workers that"
        " claimed this job, and no worker that knows it took it within unknown_task_grace"
        " (3600s; it waited 7200s)"
    )
    assert len(rig.claims) == 0


async def test_bad_arguments_fail_the_attempt_naming_task_and_argument_with_its_retry_policy(
    rig: Rig, registry: aioq.Registry
) -> None:
    calls: list[int] = []

    @registry.task(name="t.add", retry=QUICK, max_attempts=5)
    async def add(n: int) -> None:
        calls.append(n)

    await add.defer_many(rig.conn, [{"n": 1}, {"n": 2}, {"n": 3}])
    good, missing, undecodable = await rig.claim(3)
    missing = dataclasses.replace(missing, args="{}")  # as a row written by hand would be
    undecodable = dataclasses.replace(undecodable, args='{"n": 1')  # cut short in transit
    outcomes = {}
    for claim in (good, missing, undecodable):
        outcome = await rig.consumer.run_one(claim, rig.running(claim))
        assert outcome is not None
        outcomes[claim.id] = outcome
    assert calls == [1]
    assert outcomes[good.id].kind is OutcomeKind.SUCCEEDED
    for claim in (missing, undecodable):
        outcome = outcomes[claim.id]
        assert (outcome.kind, outcome.delay) == (OutcomeKind.RETRIED, QUICK.delay(1))
        assert outcome.error is not None
        assert outcome.error.startswith("PayloadError: cannot call 't.add' with its stored")
        assert "Traceback" not in outcome.error  # the message is the whole story
    assert "'n'" in (outcomes[missing.id].error or "")


async def test_an_async_task_past_its_timeout_fails_the_attempt_with_a_timeout_error(
    rig: Rig, registry: aioq.Registry
) -> None:
    never = anyio.Event()
    started: list[int] = []

    @registry.task(name="t.hang", timeout=0.1, retry=QUICK, max_attempts=3)
    async def hang() -> None:
        started.append(aioq.current_job().attempt)
        await never.wait()

    job_id = await hang.defer(rig.conn)
    [claim] = await rig.claim()
    with anyio.fail_after(HANG_GUARD):
        outcome = await rig.consumer.run_one(claim, rig.running(claim))
    assert started == [1]
    assert outcome is not None
    assert (outcome.kind, outcome.delay) == (OutcomeKind.RETRIED, QUICK.delay(1))
    assert outcome.error == "TimeoutError: task 't.hang' timed out after 0.1s"
    rig.completer.put(outcome)
    await rig.completer.flush()
    row = await rig.row(job_id)
    assert row is not None
    assert (row["status"], row["last_error"]) == ("pending", outcome.error)


async def test_sync_tasks_run_in_threads_no_more_at_once_than_the_limiter_allows(
    rig: Rig, registry: aioq.Registry
) -> None:
    # Each thread waits for a partner: with a limit of 2 they pair up; a limit of 1 would
    # time the barrier out, no limit would let all six run together.
    pair = threading.Barrier(2, timeout=HANG_GUARD)
    lock = threading.Lock()
    now_running, peak = 0, 0
    seen: list[tuple[int, int, int]] = []

    @registry.task(name="t.sync")
    def blocking(x: int) -> None:
        nonlocal now_running, peak
        with lock:
            now_running += 1
            peak = max(peak, now_running)
        seen.append((threading.get_ident(), aioq.current_job().id, x))
        pair.wait()
        with lock:
            now_running -= 1

    ids = await blocking.defer_many(rig.conn, [{"x": x} for x in range(6)])
    claims = await rig.claim(6)
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for claim in claims:
                tg.start_soon(rig.consumer.handle, claim)
        await rig.completer.flush()
    assert peak == 2
    assert threading.get_ident() not in {thread for thread, _, _ in seen}
    assert sorted((job_id, x) for _, job_id, x in seen) == sorted(zip(ids, range(6), strict=True))
    assert await rig.conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0


async def test_a_stopping_consumer_releases_its_claim_unrun_with_the_attempt_refunded(
    rig: Rig, registry: aioq.Registry
) -> None:
    ran: list[int] = []

    @registry.task(name="t.noop")
    async def noop() -> None:
        ran.append(1)

    job_id = await noop.defer(rig.conn)
    [claim] = await rig.claim()
    rig.stopping.set()
    await rig.handle(claim)
    assert ran == []
    row = await rig.row(job_id)
    assert row is not None
    assert (row["status"], row["attempts"], row["locked_by"]) == ("pending", 0, None)
    assert len(rig.claims) == 0


async def test_a_claim_whose_lease_was_lost_before_it_ran_is_dropped_and_nothing_written(
    rig: Rig, registry: aioq.Registry
) -> None:
    ran: list[int] = []

    @registry.task(name="t.noop")
    async def noop() -> None:
        ran.append(1)

    job_id = await noop.defer(rig.conn)
    [claim] = await rig.claim()
    rig.running(claim).cancel(CancelReason.LEASE_LOST)
    await rig.consumer.handle(claim)
    assert ran == []
    assert rig.completer.pending == []
    assert len(rig.claims) == 0
    row = await rig.row(job_id)
    assert row is not None
    assert (row["status"], row["locked_by"]) == ("running", "me")  # the new owner's to write


async def test_a_task_raising_cancelled_error_on_its_own_fails_only_its_attempt(
    rig: Rig, registry: aioq.Registry
) -> None:
    @registry.task(name="t.odd", retry=QUICK)
    async def odd() -> None:
        raise asyncio.CancelledError  # e.g. it awaited a future somebody else cancelled

    @registry.task(name="t.fine")
    async def fine() -> None: ...

    odd_id = await odd.defer(rig.conn)
    await fine.defer(rig.conn)
    claims = await rig.claim(2)
    with anyio.fail_after(HANG_GUARD):
        await rig.handle(*claims)  # the consumer is not cancelled: it goes on to the next
    row = await rig.row(odd_id)
    assert row is not None
    assert row["status"] == "pending"
    assert (
        "RuntimeError: the task raised CancelledError without being cancelled"
        in (row["last_error"])
    )
    assert await rig.conn.fetchval("SELECT count(*) FROM aioq.jobs") == 1  # t.fine is done


async def test_current_job_is_one_context_per_run_seen_by_threads_and_children_and_gone_after(
    rig: Rig, registry: aioq.Registry
) -> None:
    # The worker builds the context only when the task asks (current_job()): the same one
    # for the whole run, wherever the task asks from, and none once the run is over.
    seen: list[tuple[aioq.JobContext, ...]] = []

    @registry.task(name="t.ctx", max_attempts=4)
    async def ctx() -> None:
        job = aioq.current_job()
        children: list[aioq.JobContext] = []

        async def child() -> None:
            children.append(aioq.current_job())

        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
        in_thread = await anyio.to_thread.run_sync(aioq.current_job)
        seen.append((job, aioq.current_job(), in_thread, *children))

    ids = await ctx.defer_many(rig.conn, [{}, {}])
    claims = await rig.claim(2)
    await rig.handle(*claims)
    assert len(seen) == 2
    for job_id, contexts in zip(ids, seen, strict=True):
        job, again, in_thread, child = contexts
        assert again is job
        assert in_thread == job == child
        assert (job.id, job.attempt, job.max_attempts, job.task, job.worker_id) == (
            job_id,
            1,
            4,
            "t.ctx",
            "me",
        )
        assert not job.cancel_requested
    with pytest.raises(aioq.AioqError, match="outside a running aioq task"):
        aioq.current_job()
