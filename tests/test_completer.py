"""The completer on its own: batching, fencing inside a batch, back-pressure, the run loop and
the flush on stop, against a real PostgreSQL (fencing across workers: test_lease.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import asyncpg
import prometheus_client
import pytest
import statements
from waits import until_sql

import aioq
from aioq import hooks
from aioq.job import Claim, OutcomeKind
from aioq.metrics import Metrics
from aioq.worker.claims import Claims
from aioq.worker.completer import Completer, Outcome
from aioq.worker.lease import Reaper

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0
_SUCCEEDED = OutcomeKind.SUCCEEDED


def completer_for(
    conn: asyncpg.Connection,
    claims: list[Claim],
    *,
    worker_id: str = "me",
    batch_size: int = 100,
    max_pending: int = 100,
    keep_completed: bool = False,
) -> Completer:
    tracked = Claims()
    tracked.add(claims)
    return Completer(
        schema="aioq",
        db=conn,
        worker_id=worker_id,
        claims=tracked,
        keep_completed=keep_completed,
        batch_size=batch_size,
        max_pending=max_pending,
    )


async def claim_jobs(
    conn: asyncpg.Connection, registry: aioq.Registry, n: int, worker_id: str = "me"
) -> list[Claim]:
    @registry.task(name="t.work")
    async def work(i: int) -> None: ...

    await work.defer_many(conn, [{"i": i} for i in range(n)])
    return await statements.claim(conn, ["default"], n, worker_id)


async def statements_that_wrote(conn: asyncpg.Connection, table: str) -> int:
    """How many transactions wrote the rows of ``table`` (autocommit: one per statement)."""
    return await conn.fetchval(f"SELECT count(DISTINCT xmin::text) FROM aioq.{table}")  # type: ignore[no-any-return]


async def test_a_pass_writes_each_kind_of_outcome_in_one_statement(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    claims = await claim_jobs(conn, registry, 60)
    completer = completer_for(conn, claims, keep_completed=True)
    for i, claim in enumerate(claims):
        if i % 2:
            completer.put(Outcome(claim, OutcomeKind.SUCCEEDED))
        else:
            completer.put(Outcome(claim, OutcomeKind.RETRIED, delay=3600, error=f"e{i}"))
    assert await completer.run_once() == 60
    assert completer.idle
    assert len(completer.claims) == 0
    # 30 completions archived by one statement; 30 failures rescheduled by one statement.
    assert await conn.fetchval("SELECT count(*) FROM aioq.archive") == 30
    assert await statements_that_wrote(conn, "archive") == 1
    rows = await conn.fetch("SELECT status, last_error FROM aioq.jobs ORDER BY id")
    assert [(r["status"], r["last_error"]) for r in rows] == [
        ("pending", f"e{i}") for i in range(0, 60, 2)
    ]
    assert await statements_that_wrote(conn, "jobs") == 1


async def test_batch_size_bounds_a_pass_and_busy_asks_for_the_next_at_once(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    claims = await claim_jobs(conn, registry, 25)
    completer = completer_for(conn, claims, batch_size=10)
    for claim in claims:
        completer.put(Outcome(claim, OutcomeKind.SUCCEEDED))
    passes = []
    while True:
        written = await completer.run_once()
        passes.append(written)
        if not completer.busy(written):
            break
    assert passes == [10, 10, 5]
    assert await completer.run_once() == 0  # nothing left: an empty pass writes nothing
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0


async def test_stale_claims_in_a_batch_update_no_row_and_the_fresh_ones_are_written(
    conn: asyncpg.Connection, registry: aioq.Registry, caplog: pytest.LogCaptureFixture
) -> None:
    claims = await claim_jobs(conn, registry, 6)
    stale = claims[:3]
    # The reaper hands three of the jobs to another worker, which claims them again.
    await conn.execute(
        "UPDATE aioq.jobs SET lease_expires_at = now() - interval '1 second' WHERE id = ANY($1)",
        [c.id for c in stale],
    )
    await Reaper(schema="aioq", db=conn, interval=1, batch_size=10).run_once()
    retaken = await statements.claim(conn, ["default"], 10, "other")
    assert sorted(c.id for c in retaken) == sorted(c.id for c in stale)

    completer = completer_for(conn, claims)
    for claim in claims:
        completer.put(Outcome(claim, OutcomeKind.SUCCEEDED))
    with caplog.at_level(logging.WARNING, logger="aioq"):
        assert await completer.run_once() == 6
    lost = [r.getMessage() for r in caplog.records if "lease lost before" in r.getMessage()]
    assert sorted(int(m.split()[1]) for m in lost) == sorted(c.id for c in stale)
    assert len(completer.claims) == 0
    rows = await conn.fetch("SELECT id, status, locked_by FROM aioq.jobs ORDER BY id")
    assert [tuple(r) for r in rows] == [(c.id, "running", "other") for c in stale]


async def test_room_is_awaited_while_max_pending_outcomes_are_unwritten_and_put_never_waits(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    claims = await claim_jobs(conn, registry, 3)
    completer = completer_for(conn, claims, batch_size=2, max_pending=2)
    completer.put(Outcome(claims[0], OutcomeKind.SUCCEEDED))
    completer.put(Outcome(claims[1], OutcomeKind.SUCCEEDED))
    room = anyio.Event()

    async def wait_room() -> None:
        await completer.wait_room()
        room.set()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_room)
            await anyio.wait_all_tasks_blocked()
            assert not room.is_set()  # a consumer would take no job now
            # An outcome of a job that already ran is never held back (nor lost to a cancel).
            completer.put(Outcome(claims[2], OutcomeKind.SUCCEEDED))
            assert len(completer.pending) == 3
            assert await completer.run_once() == 2  # room again
            await room.wait()
    assert [o.claim for o in completer.pending] == claims[2:]
    assert await completer.run_once() == 1
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0


async def test_the_run_loop_writes_outcomes_as_they_come_and_signals_each_pass(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    claims = await claim_jobs(conn, registry, 2)
    completer = completer_for(conn, claims)
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            await tg.start(completer.run)
            for claim in claims:
                before = completer.passed.count
                completer.put(Outcome(claim, OutcomeKind.DEAD, error="boom"))
                await completer.passed.wait()
                assert completer.passed.count == before + 1  # one pass per outcome here
                row = await conn.fetchrow(
                    "SELECT status, last_error FROM aioq.jobs WHERE id = $1", claim.id
                )
                assert tuple(row) == ("dead", "boom")
            await completer.wait_idle()
            tg.cancel_scope.cancel()


async def test_flush_on_stop_writes_every_queued_outcome_beyond_one_batch(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    claims = await claim_jobs(conn, registry, 23)
    completer = completer_for(conn, claims, batch_size=5)
    for claim in claims:
        completer.put(Outcome(claim, OutcomeKind.RELEASED))
    with anyio.fail_after(HANG_GUARD):
        await completer.flush()
    assert completer.idle
    rows = await conn.fetch("SELECT status, attempts, locked_by FROM aioq.jobs")
    assert len(rows) == 23
    assert {tuple(r) for r in rows} == {("pending", 0, None)}  # released: attempt refunded


async def test_flush_gives_up_loudly_when_the_database_stays_unreachable(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, caplog: pytest.LogCaptureFixture
) -> None:
    claims = await claim_jobs(conn, registry, 2)
    gone = await asyncpg.connect(dsn)
    await gone.close()  # every write through it fails
    completer = completer_for(gone, claims)
    for claim in claims:
        completer.put(Outcome(claim, OutcomeKind.SUCCEEDED))
    with caplog.at_level(logging.ERROR, logger="aioq"), anyio.fail_after(HANG_GUARD):
        await completer.flush()
    assert "could not write 2 job outcomes" in caplog.text
    assert len(completer.pending) == 2  # kept, not silently dropped
    statuses = await conn.fetch("SELECT status FROM aioq.jobs")
    assert [r[0] for r in statuses] == ["running", "running"]  # the reaper rescues them later


# Moved from test_lease.py: the completer's handling of refused data and lost connections.


async def test_an_outcome_the_server_refuses_does_not_block_the_others(
    conn: asyncpg.Connection, registry: aioq.Registry, caplog: pytest.LogCaptureFixture
) -> None:
    @registry.task
    async def work() -> None: ...

    await work.defer_many(conn, [{}, {}])
    good, bad = await statements.claim(conn, ["default"], 10, "me")
    completer = completer_for(conn, [good, bad])
    completer.put(Outcome(good, OutcomeKind.SUCCEEDED))
    # An interval PostgreSQL cannot represent: the server refuses this outcome's data.
    completer.put(Outcome(bad, OutcomeKind.RETRIED, delay=1e300, error="x"))
    with caplog.at_level(logging.ERROR, logger="aioq"):
        assert await completer.run_once() == 2
    assert "cannot be stored" in caplog.text
    assert completer.pending == []
    # The job whose outcome was refused fails (dead, saying why): never given back for ever.
    rows = await conn.fetch("SELECT id, status, last_error, locked_by FROM aioq.jobs")
    assert [(r["id"], r["status"], r["locked_by"]) for r in rows] == [(bad.id, "dead", None)]
    assert rows[0]["last_error"].startswith(
        "OutcomeRefused: the database refused to record this attempt's outcome (retried):"
    )


async def test_a_connection_lost_before_a_write_keeps_the_whole_batch_for_the_retry(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, caplog: pytest.LogCaptureFixture
) -> None:
    @registry.task
    async def work() -> None: ...

    await work.defer_many(conn, [{}, {}])
    done, failed = await statements.claim(conn, ["default"], 10, "me")
    doomed = await asyncpg.connect(dsn)
    doomed.terminate()
    completer = completer_for(conn, [done, failed])
    completer.db = doomed
    completer.put(Outcome(done, OutcomeKind.SUCCEEDED))
    completer.put(Outcome(failed, OutcomeKind.RETRIED, delay=0, error="boom"))
    with pytest.raises(asyncpg.InterfaceError, match="closed"):
        await completer.run_once()
    # One statement for every kind: nothing was written, everything is retried.
    assert [o.claim.id for o in completer.pending] == [done.id, failed.id]

    completer.db = conn
    with caplog.at_level(logging.WARNING, logger="aioq"):
        assert await completer.run_once() == 2
    assert "lease lost" not in caplog.text
    rows = await conn.fetch("SELECT id, status, last_error FROM aioq.jobs")
    assert [tuple(r) for r in rows] == [(failed.id, "pending", "boom")]


async def test_an_outcome_whose_reply_was_lost_is_not_reported_as_a_lost_lease(
    conn: asyncpg.Connection, registry: aioq.Registry, caplog: pytest.LogCaptureFixture
) -> None:
    @registry.task
    async def work() -> None: ...

    await work.defer(conn)
    [claim] = await statements.claim(conn, ["default"], 10, "me")

    class ReplyLost:
        """The statement commits on a real connection; its reply never arrives."""

        async def fetch(self, sql: str, *args: object, **_: object) -> list[asyncpg.Record]:
            await conn.fetch(sql, *args)
            raise ConnectionResetError("connection lost before the reply")

    completer = completer_for(conn, [claim])
    completer.db = ReplyLost()  # type: ignore[assignment]
    completer.put(Outcome(claim, OutcomeKind.SUCCEEDED))
    with pytest.raises(ConnectionResetError):
        await completer.run_once()
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0  # it was written

    completer.db = conn
    with caplog.at_level(logging.INFO, logger="aioq"):
        assert await completer.run_once() == 1
    assert "lease lost" not in caplog.text
    assert "found already gone on retry" in caplog.text
    assert completer.pending == []
    assert len(completer.claims) == 0


# A heartbeat of the same worker (another connection) may update a held row after the outcome's
# statement took its snapshot and before it locks the row: the lock then finds the newer
# version, still held under the fence, and every write of the statement must reach that
# version. A write that found the row by the locked version's address (its ctid) read it with
# the statement's snapshot, saw nothing, and left the row running (the retry) or deleted it
# without its result (the success).
@pytest.mark.parametrize("kind", [OutcomeKind.RETRIED, OutcomeKind.SUCCEEDED])
async def test_an_outcome_racing_a_heartbeat_of_its_rows_is_written(
    conn: asyncpg.Connection, dsn: str, registry: aioq.Registry, kind: OutcomeKind
) -> None:
    claims = await claim_jobs(conn, registry, 3)
    heartbeat = await asyncpg.connect(dsn)
    writer = await asyncpg.connect(dsn)
    try:
        tx = heartbeat.transaction()
        await tx.start()
        await heartbeat.execute(
            "UPDATE aioq.jobs SET lease_expires_at = now() + interval '1 minute'"
            " WHERE id = ANY($1::bigint[])",
            [c.id for c in claims],
        )
        pid = await writer.fetchval("SELECT pg_backend_pid()")
        completer = completer_for(writer, claims)
        for claim in claims:  # a result kept (the success) or an error (the retry) per job
            if kind is OutcomeKind.SUCCEEDED:
                completer.put(Outcome(claim, kind, result="42", result_ttl=60.0))
            else:
                completer.put(Outcome(claim, kind, error="E: again", delay=0.0))
        async with anyio.create_task_group() as tg:
            tg.start_soon(completer.run_once)
            # The outcome's statement has its snapshot and waits for the heartbeat's locks.
            await until_sql(
                conn,
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                pid,
            )
            await tx.commit()
        rows = await conn.fetch("SELECT id, status, last_error FROM aioq.jobs ORDER BY id")
        if kind is OutcomeKind.SUCCEEDED:
            assert rows == []
            kept = await conn.fetch("SELECT id, result FROM aioq.results ORDER BY id")
            assert [(r["id"], r["result"]) for r in kept] == [(c.id, "42") for c in claims]
        else:
            assert [(r["status"], r["last_error"]) for r in rows] == [
                ("pending", "E: again")
            ] * len(claims)
    finally:
        await heartbeat.close()
        await writer.close()


class Settled(hooks.Observer):
    """Records what the completer reports as written, by outcome."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[int, int]]] = []

    def settled(
        self,
        worker_id: str,
        outcome: str,
        settled: Sequence[tuple[Claim, str | None]],
        start_ns: int,
        end_ns: int,
    ) -> None:
        self.seen += [(outcome, claim.key) for claim, _ in settled]


@pytest.mark.parametrize("stale_kind", [OutcomeKind.SUCCEEDED, OutcomeKind.RETRIED])
async def test_a_stale_claim_and_a_fresh_claim_of_one_job_in_one_batch_count_once(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    caplog: pytest.LogCaptureFixture,
    stale_kind: OutcomeKind,
) -> None:
    """The worker claimed the job again after its first claim was rescued (a blocked loop);
    both outcomes meet in one batch (COMPLETE when both succeeded, WRITE_OUTCOMES otherwise).
    Only the fresh claim's is written, and only it is reported, counted and logged as such."""
    [stale] = await claim_jobs(conn, registry, 1)
    await conn.execute("UPDATE aioq.jobs SET lease_expires_at = now() - interval '1 second'")
    await Reaper(schema="aioq", db=conn, interval=1, batch_size=10, worker_id="other").run_once()
    [fresh] = await statements.claim(conn, ["default"], 10, "me")
    assert (fresh.id, fresh.number) == (stale.id, stale.number + 1)
    completer = completer_for(conn, [stale])
    completer.claims.add([fresh])
    metrics = Metrics(registry=prometheus_client.CollectorRegistry())
    completer.metrics = metrics
    completer.put(Outcome(stale, stale_kind, error=None if stale_kind is _SUCCEEDED else "stale"))
    completer.put(Outcome(fresh, OutcomeKind.SUCCEEDED))
    observer = Settled()
    hooks.install(observer)
    try:
        with caplog.at_level(logging.INFO, logger="aioq"):
            assert await completer.run_once() == 2
    finally:
        hooks.uninstall(observer)
    assert observer.seen == [("succeeded", fresh.key)]
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
    written = [r for r in caplog.records if getattr(r, "outcome", None) == "succeeded"]
    assert len(written) == 1
    lost = [r for r in caplog.records if getattr(r, "outcome", None) == "lease_lost"]
    assert [r.getMessage().split()[1] for r in lost] == [str(stale.id)]
    labels = {"queue": "default", "task": "t.work"}
    assert metrics.registry.get_sample_value("aioq_jobs_succeeded_total", labels) == 1
    assert metrics.registry.get_sample_value("aioq_jobs_retried_total", labels) is None
    assert metrics.registry.get_sample_value("aioq_jobs_lease_lost_total", labels) == 1
    assert len(completer.claims) == 0
