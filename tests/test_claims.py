"""Claim identity: every claim is known by (job id, claim number), never reused.

A write whose reply was lost is retried by the completer; it must never land on a later claim
of the same job by the same worker, nor make the worker forget that later claim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import asyncpg
import pytest
from faults import After, pool_with_fault
from waits import until_sql

import aioq
from aioq.sql.outcomes import WRITE_OUTCOMES

pytestmark = pytest.mark.anyio

MakeWorker = Callable[..., aioq.Worker]
HANG_GUARD = 30.0


def loses_replies(lose: int) -> After:
    """The next ``lose`` outcome writes that send a job back to pending commit, then fail as
    if the reply was lost."""
    left = [lose]

    async def after(args: Sequence[object], rows: list[Any]) -> None:
        kinds = args[3]
        assert isinstance(kinds, list)
        if left[0] and {"retried", "snoozed"} & set(kinds):
            left[0] -= 1
            raise ConnectionResetError("connection lost before the reply (injected)")

    return after


async def gone(conn: asyncpg.Connection) -> None:
    """Wait until no job is left in the table (exiting the worker then waits for its runs)."""
    await until_sql(conn, "SELECT NOT EXISTS (SELECT FROM aioq.jobs)", guard=HANG_GUARD)


class Runs:
    """What the runs of a job saw, and whether two ever overlapped."""

    def __init__(self) -> None:
        self.seen: list[aioq.JobContext] = []
        self.active = 0
        self.overlapped = False

    def start(self) -> aioq.JobContext:
        job = aioq.current_job()
        self.seen.append(job)
        self.active += 1
        self.overlapped |= self.active > 1
        return job

    def end(self) -> None:
        self.active -= 1


async def test_a_lost_reply_on_a_snooze_never_reschedules_the_next_claim(
    conn: asyncpg.Connection, dsn: str, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    runs = Runs()

    @registry.task(name="t.snooze_once")
    async def snooze_once() -> None:
        runs.start()
        try:
            if len(runs.seen) == 1:
                raise aioq.Retry(0)  # ready at once: this worker claims it again right away
            # The completer retries the lost write while this second run goes on.
            await anyio.sleep(1.0)
        finally:
            runs.end()

    await snooze_once.defer(conn)
    async with (
        pool_with_fault(dsn, WRITE_OUTCOMES, loses_replies(1)) as pool,
        make_worker(pool=pool),
    ):
        await gone(conn)
    assert len(runs.seen) == 2, [j.attempt for j in runs.seen]
    assert not runs.overlapped
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0


async def test_a_lost_reply_on_a_failure_never_drops_the_next_claim(
    conn: asyncpg.Connection, dsn: str, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    runs = Runs()

    # No backoff: the retry is ready at once and this worker claims it again right away.
    @registry.task(name="t.fail_once", lease=1.0, retry=aioq.Backoff(base=0, max=0, jitter=0))
    async def fail_once() -> None:
        runs.start()
        try:
            if len(runs.seen) == 1:
                raise ValueError("first run fails")
            # Outlives its lease: only the heartbeat keeps it, which it must not forget
            # when the completer retries the first run's lost write.
            await anyio.sleep(2.5)
        finally:
            runs.end()

    await fail_once.defer(conn)
    # A fast reaper: had the worker forgotten the second claim, its lease would lapse and be
    # rescued within the run.
    async with (
        pool_with_fault(dsn, WRITE_OUTCOMES, loses_replies(1)) as pool,
        make_worker(pool=pool, heartbeat_interval=0.1, reaper_interval=0.1),
    ):
        await gone(conn)
    assert len(runs.seen) == 2, [j.attempt for j in runs.seen]
    assert not runs.overlapped
    assert [j.attempt for j in runs.seen] == [1, 2]
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0


async def test_snoozes_count_as_runs_and_never_spend_the_failure_budget(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    runs = Runs()

    @registry.task(name="t.poll", max_attempts=2)
    async def poll() -> None:
        job = runs.start()
        runs.end()
        if job.attempt < 4:
            raise aioq.Retry(0)

    job_id = await poll.defer(conn)
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()
    assert [(j.attempt, j.snoozes, j.max_attempts) for j in runs.seen] == [
        (1, 0, 2),
        (2, 1, 3),
        (3, 2, 4),
        (4, 3, 5),
    ]
    assert not any(j.is_last_attempt for j in runs.seen[:-1])
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE id = $1", job_id) == 0


async def test_after_snoozes_a_failure_still_has_its_whole_budget(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="t.snooze_then_fail", max_attempts=2, retry=aioq.Backoff(base=0, max=0))
    async def snooze_then_fail() -> None:
        if aioq.current_job().snoozes < 3:
            raise aioq.Retry(0)
        raise ValueError("broken")

    job_id = await snooze_then_fail.defer(conn)
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()
    row = await conn.fetchrow("SELECT * FROM aioq.jobs WHERE id = $1", job_id)
    # Three snoozes, then the two failures max_attempts=2 allows.
    assert (row["status"], row["attempts"], row["snoozes"], row["max_attempts"]) == (
        "dead",
        5,
        3,
        5,
    )
    assert "ValueError: broken" in row["last_error"]
