"""Who rings the doorbell (docs/architecture.md, "The doorbell"): every statement of aioq that
makes a job claimable rings it itself, raw-SQL inserts ring through aioq.admin.ring() or the opt-in
trigger, and nothing rings for a queue nobody can claim from or between inserters.

A connection here goes on duty for the test queues, as a sleeping worker does, and stays on
duty (it is never rung off): every statement that should ring does, once per transaction.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from datetime import timedelta

import anyio
import asyncpg
import psycopg
import pytest
import statements
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from procs import aioq_cli
from waits import eventually

import aioq
from aioq.job import OutcomeKind
from aioq.migrate import migrations, ring_trigger_sql
from aioq.sql import Statement
from aioq.sql import jobs as job_statements
from aioq.sql.outcomes import RELEASE_WORKER, RESCUE_EXPIRED
from aioq.sql.schedules import SCHEDULE_START, SCHEDULE_TICK, ScheduleStart, ScheduleTick

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0
SLOW_POLL = 60.0  # longer than any wait here: a prompt pickup can only come from a ring
RAW_INSERT = "INSERT INTO aioq.jobs (queue, task) VALUES ($1, 'raw')"


class Spy:
    """Every payload on the default schema's channel, with the backend that sent it."""

    def __init__(self) -> None:
        self._send: MemoryObjectSendStream[tuple[int, str]]
        self._receive: MemoryObjectReceiveStream[tuple[int, str]]
        self._send, self._receive = anyio.create_memory_object_stream[tuple[int, str]](math.inf)

    def on_notify(self, conn: object, pid: int, channel: str, payload: str) -> None:
        self._send.send_nowait((pid, payload))

    async def until_sentinel(self, sender: asyncpg.Connection) -> list[str]:
        """What arrived before a sentinel sent now (notifications arrive in order)."""
        await sender.execute("SELECT pg_notify('aioq:aioq', 'sentinel')")
        seen: list[str] = []
        with anyio.fail_after(HANG_GUARD):
            async for _, payload in self._receive:
                if payload == "sentinel":
                    return seen
                seen.append(payload)
        raise AssertionError("the notification stream closed")  # pragma: no cover

    def close(self) -> None:
        self._send.close()
        self._receive.close()


async def _listening(dsn: str, duty: list[str]) -> tuple[asyncpg.Connection, Spy]:
    conn = await asyncpg.connect(dsn)
    spy = Spy()
    await conn.add_listener("aioq:aioq", spy.on_notify)
    if duty:
        assert not await statements.arm(conn, duty)  # on duty: nothing was in flight
    return conn, spy


@pytest.fixture(params=["q", "any queue"])
async def on_duty(dsn: str, request: pytest.FixtureRequest) -> AsyncIterator[Spy]:
    """A connection on duty for queue ``q`` (as a sleeping worker), or for any queue (the
    wildcard, as a worker of more queues than it arms one by one), and what it hears."""
    conn, spy = await _listening(dsn, ["q" if request.param == "q" else ""])
    try:
        yield spy
    finally:
        await conn.close()
        spy.close()


@pytest.fixture
async def unarmed(dsn: str) -> AsyncIterator[Spy]:
    """What a plain LISTEN hears, with nobody on duty."""
    conn, spy = await _listening(dsn, [])
    try:
        yield spy
    finally:
        await conn.close()
        spy.close()


async def test_every_statement_that_makes_a_job_claimable_rings(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, on_duty: Spy
) -> None:
    @registry.task(queue="q")
    async def work(n: int = 0) -> None: ...

    async def rings(what: str, step: Callable[[], object]) -> None:
        result = step()
        if hasattr(result, "__await__"):
            await result
        assert await on_duty.until_sentinel(conn) == ["q"], what

    # A workflow: its defer rings for its first step (not for the one that waits), and the
    # statement that records the first step's success rings for the step it makes ready.
    flow = aioq.Workflow("rings")
    first = flow.add(work.call(n=1))
    flow.add(work.call(n=2), after=[first])
    await rings("a workflow's defer", lambda: flow.defer(conn))
    [claim] = await statements.claim(conn, ["q"], 1, "w")
    await rings(
        "a fan-in",
        lambda: statements.write(conn, "w", [claim], OutcomeKind.SUCCEEDED, steps=True),
    )
    [claim] = await statements.claim(conn, ["q"], 1, "w")  # the step the fan-in made ready
    await statements.write(conn, "w", [claim], OutcomeKind.SUCCEEDED, steps=True)
    assert await on_duty.until_sentinel(conn) == []  # the last step: nothing made ready

    await rings("defer", lambda: work.defer(conn))
    await rings("defer with options", lambda: work.options(priority=3).defer(conn))
    await rings("defer_many", lambda: work.defer_many(conn, [{"n": 1}, {"n": 2}]))
    await rings("a keyed defer", lambda: work.options(concurrency_key="k").defer(conn))
    await rings(
        "a keyed defer_many",
        lambda: work.options(concurrency_key="k").defer_many(conn, [{"n": 3}]),
    )
    await rings("a unique defer", lambda: work.options(unique_key="u1").defer(conn))
    await rings(
        "a unique_for defer", lambda: work.options(unique_key="u2", unique_for=60).defer(conn)
    )
    # Not claimable yet: no ring; its replace by a job due now: a ring.
    later = work.options(unique_key="u3", delay=3600, concurrency_key="k2")
    await later.defer(conn)
    assert await on_duty.until_sentinel(conn) == []
    await rings(
        "a replace that makes a job due",
        lambda: work.options(unique_key="u3", on_conflict="replace", concurrency_key="k2").defer(
            conn
        ),
    )
    with psycopg.connect(dsn, autocommit=True) as sync:
        await rings("defer_sync", lambda: work.defer_sync(sync, n=4))
        await rings("defer_many_sync", lambda: work.defer_many_sync(sync, [{"n": 5}]))

    # A schedule's tick, due now.
    now = await conn.fetchval("SELECT now()")
    tick = now - timedelta(minutes=1)
    spec = {"name": "tick", "task": work.name, "queue": "q", "spec": "every 60s"}
    start = ScheduleStart(**spec, last_tick=tick - timedelta(minutes=1), next_tick=tick)
    await SCHEDULE_START.row(conn, "aioq", start)
    ticks = ScheduleTick(
        **spec, ticks=[tick], next_tick=now, args="{}", priority=0, max_attempts=5, lease=30.0
    )
    await rings("a schedule's tick", lambda: SCHEDULE_TICK.rows(conn, "aioq", ticks))

    # Outcomes that make a job claimable again, at once.
    [claim] = await statements.claim(conn, ["q"], 1, "w")
    assert await on_duty.until_sentinel(conn) == []  # the claim rings nothing
    await rings("a release", lambda: statements.write(conn, "w", [claim], OutcomeKind.RELEASED))
    [claim] = await statements.claim(conn, ["q"], 1, "w")
    await rings(
        "a retry due now", lambda: statements.write(conn, "w", [claim], OutcomeKind.RETRIED)
    )
    [claim] = await statements.claim(conn, ["q"], 1, "w")
    await statements.write(conn, "w", [claim], OutcomeKind.RETRIED, delay=3600)
    assert await on_duty.until_sentinel(conn) == []  # a retry later rings nothing
    await statements.claim(conn, ["q"], 1, "w")
    await rings("a worker's release", lambda: RELEASE_WORKER.rows(conn, "aioq", "w", []))
    [claim] = await statements.claim(conn, ["q"], 1, "w")
    await conn.execute(
        "UPDATE aioq.jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
        claim.id,
    )
    await rings("the reaper", lambda: RESCUE_EXPIRED.rows(conn, "aioq", 10, "other"))
    [claim] = await statements.claim(conn, ["q"], 1, "w")
    await statements.write(conn, "w", [claim], OutcomeKind.DEAD, error="boom")
    assert await on_duty.until_sentinel(conn) == []
    await rings("a replay", lambda: aioq.admin.replay(conn, job_id=claim.id))


async def test_raw_inserts_ring_through_aioq_ring_or_the_opt_in_trigger(
    dsn: str, conn: asyncpg.Connection, on_duty: Spy
) -> None:
    # Without either: a raw insert rings nothing (the workers' polls find it).
    await conn.execute(RAW_INSERT, "q")
    assert await on_duty.until_sentinel(conn) == []

    # aioq.admin.ring in the inserting transaction: one ring, at its commit.
    async with conn.transaction():
        await conn.execute(RAW_INSERT, "q")
        await aioq.admin.ring(conn, "q")
        other = await asyncpg.connect(dsn)
        try:
            assert await on_duty.until_sentinel(other) == []  # not before the commit
        finally:
            await other.close()
    assert await on_duty.until_sentinel(conn) == ["q"]

    # After the commit, on a pool; and from synchronous code.
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
        await pool.execute(RAW_INSERT, "q")
        await aioq.admin.ring(pool, "q")
    assert await on_duty.until_sentinel(conn) == ["q"]
    with psycopg.connect(dsn, autocommit=True) as sync, sync.transaction():
        sync.execute("INSERT INTO aioq.jobs (queue, task) VALUES ('q', 'raw')")
        aioq.admin.ring_sync(sync, "q")
    assert await on_duty.until_sentinel(conn) == ["q"]
    with pytest.raises(aioq.errors.ConfigError):
        await aioq.admin.ring(conn, "")

    # The opt-in trigger: raw inserts ring like aioq's own (due jobs only).
    assert "CREATE TRIGGER jobs_doorbell" in ring_trigger_sql()
    assert any("DROP TRIGGER IF EXISTS jobs_doorbell" in m.sql for m in migrations())
    assert await aioq.install(conn, ring_trigger=True) == []
    await conn.execute(RAW_INSERT, "q")
    assert await on_duty.until_sentinel(conn) == ["q"]
    await conn.execute(
        "INSERT INTO aioq.jobs (queue, task, run_at) VALUES ('q', 'raw', now() + interval '1h')"
    )
    assert await on_duty.until_sentinel(conn) == []
    # With the trigger too, an aioq insert rings once.
    await aioq.Registry().task(name="raw", queue="q")(_noop).defer(conn)
    assert await on_duty.until_sentinel(conn) == ["q"]


async def _noop() -> None: ...


def test_the_cli_prints_and_installs_the_ring_trigger(dsn: str) -> None:
    printed = aioq_cli(None, "schema", "sql", "--ring-trigger")
    assert printed.returncode == 0, printed.stderr
    assert "CREATE TRIGGER jobs_doorbell" in printed.stdout
    assert "CREATE TABLE" not in printed.stdout
    whole = aioq_cli(None, "schema", "sql")
    assert "aioq:ring-trigger" not in whole.stdout  # what `schema apply` applies, no more

    async def triggers() -> int:
        conn = await asyncpg.connect(dsn)
        try:
            count = "SELECT count(*) FROM pg_trigger WHERE tgname = 'jobs_doorbell'"
            return int(await conn.fetchval(count))
        finally:
            await conn.close()

    assert anyio.run(triggers) == 0
    assert aioq_cli(dsn, "schema", "apply").returncode == 0
    assert anyio.run(triggers) == 0
    applied = aioq_cli(dsn, "schema", "apply", "--ring-trigger")
    assert applied.returncode == 0, applied.stderr
    assert anyio.run(triggers) == 1


async def test_concurrent_inserters_never_ring_each_other(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, unarmed: Spy
) -> None:
    """No worker at all: inserters only ever take the doorbell's key shared, so none of them
    ever sees another as a worker on duty."""
    for statement in (s for s in vars(job_statements).values() if isinstance(s, Statement)):
        text = statement.text("aioq")
        assert "pg_try_advisory_lock(" not in text
        if "INSERT INTO" in text:
            assert "pg_try_advisory_xact_lock_shared" in text  # the ring, in the statement

    @registry.task(queue="q")
    async def work() -> None: ...

    async def defer_in_transactions(inserter: asyncpg.Connection) -> None:
        for _ in range(50):
            async with inserter.transaction():
                await work.defer(inserter)

    inserters = [await asyncpg.connect(dsn) for _ in range(16)]
    try:
        async with anyio.create_task_group() as tg:
            for inserter in inserters:
                tg.start_soon(defer_in_transactions, inserter)
    finally:
        for inserter in inserters:
            await inserter.close()
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 800
    assert await unarmed.until_sentinel(conn) == []


async def _on_duty_for(conn: asyncpg.Connection, queue: str) -> int:
    """Workers' LISTEN sessions holding a doorbell lock of ``queue`` (duty or standby)."""
    return int(
        await conn.fetchval(
            """
            SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
            WHERE l.locktype = 'advisory' AND l.granted
              AND (l.classid::bigint << 32 | l.objid::bigint)
                  IN (aioq.doorbell_key($1), hashtextextended($1, ~'aioq.jobs'::regclass::oid::bigint))
              AND a.datname = current_database() AND a.application_name LIKE 'aioq listener %'
            """,
            queue,
        )
    )


@pytest.mark.parametrize("limit", ["paused", "max_running"])
async def test_a_queue_nobody_can_claim_from_rings_nobody(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    unarmed: Spy,
    limit: str,
) -> None:
    """One idle worker; its queue paused (or at max_running with the worker's own job): the
    worker does not arm it, so inserts ring nobody; the resume (or the job's end) wakes it."""
    release = anyio.Event()
    ran: list[int] = []

    @registry.task(queue="held", lease=2.0)
    async def job(n: int) -> None:
        ran.append(n)
        if n == 0:
            await release.wait()

    async with make_worker(
        poll_interval=SLOW_POLL, queues=["held"], heartbeat_interval=0.5, concurrency=4
    ) as worker:
        assert worker.current.listener is not None
        if limit == "paused":
            await aioq.admin.set_queue(conn, "held", paused=True, max_running=None)
        else:
            await aioq.admin.set_queue(conn, "held", max_running=1)
            await job.defer(conn, n=0)
            await eventually(lambda: ran == [0], "the first job to start", HANG_GUARD)
        # The worker claimed (nothing) since, and left the queue's doorbell.
        await eventually(lambda: _off_duty(conn, "held"), "the worker to disarm")
        await unarmed.until_sentinel(conn)
        inserters = [await asyncpg.connect(dsn) for _ in range(8)]
        try:

            async def defer_some(inserter: asyncpg.Connection, first: int) -> None:
                for n in range(first, first + 10):
                    await job.defer(inserter, n=n)

            async with anyio.create_task_group() as tg:
                for k, inserter in enumerate(inserters):
                    tg.start_soon(defer_some, inserter, 1 + 10 * k)
        finally:
            for inserter in inserters:
                await inserter.close()
        assert await unarmed.until_sentinel(conn) == []  # 80 inserts, no NOTIFY
        assert ran == ([] if limit == "paused" else [0])
        if limit == "paused":
            await aioq.admin.set_queue(conn, "held", paused=False)
        else:
            release.set()
        # The poll is a minute away: only the limits' notification (or the end of the job
        # that held the limit) explains a prompt start.
        await eventually(lambda: len(ran) >= 2, "a job to start after the limit lifted", HANG_GUARD)
        release.set()


async def _off_duty(conn: asyncpg.Connection, queue: str) -> bool:
    return await _on_duty_for(conn, queue) == 0


async def test_a_workflow_step_made_ready_rings_only_when_claimable_now(
    conn: asyncpg.Connection, registry: aioq.Registry, on_duty: Spy
) -> None:
    """A step released by its dependency's success, or (on_failure="run") by its death in the
    cascade trigger, rings its queue when it is claimable now, not when its delay starts."""

    @registry.task(queue="q")
    async def work(n: int = 0) -> None: ...

    async def step_then(kind: OutcomeKind, delay: float, on_failure: str) -> list[str]:
        flow = aioq.Workflow("rings")
        first = flow.add(work.call(n=1))
        flow.add(work.options(delay=delay).call(n=2), after=[first], on_failure=on_failure)
        await flow.defer(conn)
        assert await on_duty.until_sentinel(conn) == ["q"]  # the first step
        [claim] = await statements.claim(conn, ["q"], 1, "w")
        await statements.write(conn, "w", [claim], kind, error="boom", steps=True)
        seen = await on_duty.until_sentinel(conn)
        await conn.execute("DELETE FROM aioq.jobs")
        return seen

    assert await step_then(OutcomeKind.SUCCEEDED, 0, "cancel") == ["q"]
    assert await step_then(OutcomeKind.SUCCEEDED, 3600, "cancel") == []
    assert await step_then(OutcomeKind.DEAD, 0, "run") == ["q"]  # the cascade trigger rings
    assert await step_then(OutcomeKind.DEAD, 3600, "run") == []


async def test_the_cascade_trigger_rings_nobody_when_nobody_is_on_duty(
    conn: asyncpg.Connection, registry: aioq.Registry, unarmed: Spy
) -> None:
    """The step the cascade trigger makes ready (on_failure="run") rings as aioq's statements
    do: a NOTIFY only when a worker is on duty for its queue."""

    @registry.task(queue="q")
    async def work(n: int = 0) -> None: ...

    flow = aioq.Workflow("quiet")
    first = flow.add(work.call(n=1))
    anyway = flow.add(work.call(n=2), after=[first], on_failure="run")
    run = await flow.defer(conn)
    [claim] = await statements.claim(conn, ["q"], 1, "w")
    await statements.write(conn, "w", [claim], OutcomeKind.DEAD, error="boom", steps=True)
    assert (
        await conn.fetchval("SELECT status FROM aioq.jobs WHERE id = $1", run.jobs[anyway.name])
        == "pending"
    )
    assert await unarmed.until_sentinel(conn) == []
