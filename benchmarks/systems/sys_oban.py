"""Oban for Python (free edition): ``Oban.enqueue`` / ``enqueue_many``, an ``Oban`` with a queue.

Oban needs Python >= 3.12: run.py runs its cells with the interpreter of its own virtual
environment (benchmarks/.venv-oban, envs.py). run.py itself (Python 3.11) imports this module
only for its description, so the library is imported where it is there.

Configured as its documentation shows: ``Oban.create_pool(dsn)`` (at most 10 connections),
``queues={"default": concurrency}`` (a queue's limit is the number of its jobs that run at
once in this Oban instance: a per-worker cap, as aioq's ``concurrency``), everything else its
defaults. What it does differently: it keeps completed rows (its pruner deletes them after a
day), and the free edition inserts ``enqueue_many`` one INSERT per job (in one transaction) and
acknowledges each job with its own UPDATE (batched per fetch loop, one statement per job):
bulk inserts and bulk acks are in Oban Pro.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import systems
from systems import System, run_job

QUEUE = "default"

try:
    from oban import Oban, job
except ImportError:  # run.py's interpreter: the description only
    Oban = job = None  # type: ignore[assignment,misc]

if job is not None:

    @job(queue=QUEUE)
    async def noop(i: int, blob: object = None) -> None:
        """The no-op job."""
        await run_job(i)


class Adapter(System):
    name = "oban"
    single_api = "Oban.enqueue(noop.new(i=...))"
    bulk_api = "Oban.enqueue_many([noop.new(i=...), ...])"
    concurrency_api = "Oban(queues={'default': c}): the queue's limit in this instance"
    mapping = (
        "`Oban.create_pool(dsn)` (its default: at most 10 connections); LISTEN/NOTIFY from the "
        "insert statement, its stager every 1 s; free edition: one INSERT per job in "
        "`enqueue_many` and one UPDATE per acknowledged job; keeps completed rows (pruned "
        "after a day)"
    )

    async def install(self, dsn: str) -> None:
        from oban.schema import install

        pool = await Oban.create_pool(dsn)
        try:
            await install(pool)
        finally:
            await pool.close()

    async def open(self, dsn: str) -> None:
        self.dsn = dsn
        self.pool = await Oban.create_pool(dsn)
        # No queues: a client that only enqueues (its documented client mode).
        self.oban = Oban(pool=self.pool, name=f"bench-client-{id(self)}")

    async def close(self) -> None:
        await self.pool.close()

    def _job(self, i: int) -> Any:
        return noop.new(i) if systems.blob is None else noop.new(i, systems.blob)

    async def defer_one(self, i: int) -> None:
        await self.oban.enqueue(self._job(i))

    async def defer_many(self, start: int, count: int) -> None:
        await self.oban.enqueue_many([self._job(i) for i in range(start, start + count)])

    async def remaining(self) -> int:
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM oban_jobs"
                " WHERE state IN ('available', 'scheduled', 'executing', 'retryable')"
            )
            row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    @contextlib.asynccontextmanager
    async def worker(
        self, concurrency: int, *, poll_interval: float = 1.0, listen: bool = True
    ) -> AsyncIterator[None]:
        pool = await Oban.create_pool(self.dsn)
        oban = Oban(
            pool=pool,
            name=f"bench-worker-{id(self)}",
            queues={QUEUE: concurrency},
            shutdown_grace_period=5.0,  # as aioq's in these runs (a capped drain stops sooner)
        )
        await oban.start()
        try:
            yield
        finally:
            await oban.stop()
            await pool.close()
