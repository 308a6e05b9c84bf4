"""Scenario 10: ``defer`` inside nested transactions (savepoints), run by a worker process.

Random trees of savepoints -- each released or rolled back, some rolled back by an exception
or a failing statement, the outer transaction committed or rolled back -- defer jobs while a
real worker process serves the queue. A job exists, rings its queue's doorbell and runs
(exactly once) iff every level around it was released and the outer transaction committed;
nothing rings before the commit. tests/test_defer.py covers one rolled-back savepoint
in-process; this is the same contract end to end.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import asyncpg
import pytest
import statements
from harness import (
    HANG_GUARD,
    LONG,
    RUNS_TABLE,
    WorkerProcess,
    chaos_seed,
    fetch,
    run_counts,
    run_times,
    scaled,
    value,
    wait_for,
    write_tasks,
)
from waits import eventually

import aioq

pytestmark = pytest.mark.chaos

TASKS = """
registry = aioq.Registry()


@registry.task(name="sp.work")
async def work(n: int) -> None:
    await record("ok")
"""

registry = aioq.Registry()


@registry.task(name="sp.work", queue="sp")
async def work(n: int) -> None: ...


NOW = "SELECT clock_timestamp()"


class Boom(Exception):
    """Raised inside a savepoint to roll it back."""


class Tree:
    """Defers jobs in a random tree of savepoints and knows which ones must survive."""

    def __init__(self, conn: asyncpg.Connection, rng: random.Random) -> None:
        self.conn = conn
        self.rng = rng
        self.n = 0

    async def defer_some(self) -> list[int]:
        self.n += 1
        if self.rng.random() < 0.7:
            return [await work.defer(self.conn, n=self.n)]
        count = self.rng.randint(1, 5)
        return await work.defer_many(self.conn, [{"n": self.n}] * count)

    async def block(self, depth: int) -> tuple[list[int], list[int]]:
        """Run one level; return (ids alive at its end, ids rolled back inside it)."""
        alive: list[int] = []
        gone: list[int] = []
        for _ in range(self.rng.randint(1, 3)):
            if depth >= 4 or self.rng.random() < 0.5:
                alive += await self.defer_some()
                continue
            [ending] = self.rng.choices(
                ["release", "rollback", "exception", "failed statement"], weights=[4, 2, 1, 1]
            )
            if ending == "exception":
                inner: tuple[list[int], list[int]] = ([], [])
                try:
                    async with self.conn.transaction():
                        inner = await self.block(depth + 1)
                        raise Boom
                except Boom:
                    pass
                gone += inner[0] + inner[1]
                continue
            savepoint = self.conn.transaction()
            await savepoint.start()
            kept, lost = await self.block(depth + 1)
            if ending == "failed statement":
                with pytest.raises(asyncpg.DivisionByZeroError):
                    await self.conn.execute("SELECT 1 / 0")
            if ending == "release":
                await savepoint.commit()
                alive += kept
                gone += lost
            else:
                await savepoint.rollback()
                gone += kept + lost
        return alive, gone


@pytest.fixture
def worker(dsn: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    """One worker process serving the ``sp`` queue, listening."""
    fetch(dsn, RUNS_TABLE)
    module = write_tasks(tmp_path, "sptasks", TASKS)
    with WorkerProcess(
        f"{module}:registry", "--queue", "sp", "--concurrency", "4", "--poll-interval", "0.5",
        dsn=dsn, cwd=tmp_path, env={"CHAOS_RECORD_DSN": dsn},
    ) as process:  # fmt: skip
        process.wait_listening(dsn)
        yield process


@pytest.mark.parametrize("duty", ["sp", ""], ids=["queue", "any queue"])
def test_random_savepoint_trees_run_exactly_the_committed_jobs(
    dsn: str, worker: WorkerProcess, duty: str
) -> None:
    """The listener below is on duty for the queue, or for any queue (the wildcard, as a
    worker of more queues than it arms one by one): inserts ring through either key."""
    rounds = scaled(25, 400)
    seed = chaos_seed()
    rng = random.Random(seed)
    expected: set[int] = set()
    vanished: set[int] = set()
    notified: list[str] = []
    outcomes = {"commit": 0, "rollback": 0}
    committed_at: dict[int, datetime] = {}

    async def quiet_until_sentinel(other: asyncpg.Connection, name: str) -> list[str]:
        """Every payload received up to a sentinel notified now from another connection."""
        await other.execute("SELECT pg_notify('aioq:aioq', $1)", name)
        await eventually(lambda: name in notified, f"the {name} notification", HANG_GUARD)
        return notified[: notified.index(name)]

    async def scenario() -> None:
        conn = await asyncpg.connect(dsn)
        other = await asyncpg.connect(dsn)
        listener = await asyncpg.connect(dsn)
        await listener.add_listener("aioq:aioq", lambda *args: notified.append(args[-1]))
        # Wait on the queue as a sleeping worker does: only then do inserts ring. One worker
        # is on duty for a queue at a time, and leaves it when rung: this listener takes it
        # for good while the queue is paused (the worker does not arm a queue it cannot
        # claim from), so the worker sleeps on its watch.
        await aioq.admin.set_queue(other, "sp", paused=True, max_running=None)
        await eventually(lambda: _worker_off_duty(other), "the worker to leave duty", HANG_GUARD)
        assert not await statements.arm(listener, [duty])
        await aioq.admin.set_queue(other, "sp", paused=False)
        # The resume rings the queue (and tells workers that limits changed): both arrive
        # before this sentinel, so neither passes for round 0's.
        await quiet_until_sentinel(other, "resumed")
        try:
            for i in range(rounds):
                notified.clear()
                tree = Tree(conn, rng)
                tx = conn.transaction()
                await tx.start()
                alive, gone = await tree.block(0)
                # The worker cannot see them, and nothing has rung, before the commit.
                assert "sp" not in await quiet_until_sentinel(other, f"before-{i}")
                invisible = "SELECT count(*) FROM aioq.jobs WHERE id = ANY($1)"
                assert await other.fetchval(invisible, alive) == 0
                committed = rng.random() >= 0.25
                if committed:
                    await tx.commit()
                    committed_at.update(dict.fromkeys(alive, await other.fetchval(NOW)))
                    expected.update(alive)
                    vanished.update(gone)
                else:
                    await tx.rollback()
                    vanished.update(alive + gone)
                outcomes["commit" if committed else "rollback"] += 1
                # One doorbell at commit iff a job survived; none for a rollback.
                rang = await quiet_until_sentinel(other, f"after-{i}")
                assert rang.count("sp") == (1 if committed and alive else 0), rang
        finally:
            for c in (conn, other, listener):
                await c.close()

    asyncio.run(scenario())
    wait_for(
        lambda: (
            value(dsn, "SELECT count(*) FROM aioq.jobs") == 0 and set(run_counts(dsn)) >= expected
        ),
        f"the worker to run the {len(expected)} committed jobs (seed {seed})",
        on_timeout=worker.log,
    )
    assert worker.stop() == 0, worker.log()[-3000:]
    ran = run_counts(dsn)
    assert set(ran) == expected, f"seed {seed}"
    assert set(ran.values()) == {1}, f"seed {seed}"
    assert not expected & vanished
    started = run_times(dsn)
    latency = max((started[i] - committed_at[i]).total_seconds() for i in expected)
    print(
        f"\nsavepoints (seed {seed}): {rounds} transactions ({outcomes['commit']} committed),"
        f" {len(expected)} jobs kept and run once, {len(vanished)} rolled back and never run;"
        f" commit to run at most {latency:.2f}s"
    )
    if LONG:
        assert outcomes["rollback"] > 0


def test_savepoints_with_unique_keys_errors_and_a_pool(dsn: str, worker: WorkerProcess) -> None:
    keyed = work.options(unique_key="order-1")

    async def scenario() -> dict[int, int]:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
        try:
            async with pool.acquire() as conn, conn.transaction():
                try:
                    async with conn.transaction():
                        rolled = await keyed.defer(conn, n=1)
                        raise Boom
                except Boom:
                    pass
                kept = await keyed.defer(conn, n=2)  # the key is free again
                assert kept != rolled
                async with conn.transaction():
                    assert await keyed.defer(conn, n=3) == kept  # the live job holds it
                savepoint = conn.transaction()
                await savepoint.start()
                failed = await work.defer(conn, n=4)
                with pytest.raises(asyncpg.UniqueViolationError):
                    await conn.execute(
                        "INSERT INTO aioq.jobs (id, task) OVERRIDING SYSTEM VALUE VALUES ($1, 'x')",
                        kept,
                    )
                await savepoint.rollback()
                after = await work.defer(conn, n=5)
                [many] = await work.defer_many(conn, [{"n": 6}])
            async with pool.acquire() as conn:
                tx = conn.transaction()
                await tx.start()
                async with conn.transaction():
                    released = await work.defer(conn, n=7)
                await tx.rollback()
            gone = {rolled, failed, released}
            return {kept: 2, after: 5, many: 6, **dict.fromkeys(gone, 0)}
        finally:
            await pool.close()

    jobs = asyncio.run(scenario())
    expected = {job_id for job_id, n in jobs.items() if n}
    wait_for(
        lambda: (
            set(run_counts(dsn)) >= expected and value(dsn, "SELECT count(*) FROM aioq.jobs") == 0
        ),
        "the three committed jobs",
        on_timeout=worker.log,
    )
    assert worker.stop() == 0, worker.log()[-3000:]
    assert run_counts(dsn) == dict.fromkeys(expected, 1)


async def _worker_off_duty(conn: asyncpg.Connection) -> bool:
    held = await conn.fetchval(
        """
        SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted
          AND a.datname = current_database() AND a.application_name LIKE 'aioq listener %'
        """
    )
    return held == 0
