"""chancy: ``Chancy.push`` / ``push_many``, a ``Worker`` serving an asyncio-executor queue."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import psycopg
from chancy import Chancy, Job, Queue, Worker

import systems
from systems import System, run_job

QUEUE = "default"


async def noop(i: int, blob: object = None) -> None:
    """The no-op job."""
    await run_job(i)


def _quiet() -> logging.Logger:
    log = logging.getLogger("bench.chancy")
    log.setLevel(logging.WARNING)
    return log


class Adapter(System):
    name = "chancy"
    shared_pool = True  # defer_one from many coroutines through Chancy's own pool
    single_api = "Chancy.push(job)"
    bulk_api = "Chancy.push_many(jobs, batch_size=1000)"
    concurrency_api = "Queue(concurrency=c, executor=Async)"
    mapping = (
        "a queue's concurrency is per worker (its docs); the asyncio executor (its default is "
        "a process pool), polling every 1 s (its default 5 s) and `eager_polling` (fetch again "
        "as a job completes: its docs' advice for queues that always have work); keeps "
        "finished rows"
    )

    async def install(self, dsn: str) -> None:
        async with Chancy(dsn, log=_quiet()) as chancy:
            await chancy.migrate()
            await chancy.declare(Queue(QUEUE, executor=Chancy.Executor.Async))

    async def open(self, dsn: str) -> None:
        self.dsn = dsn
        self.chancy = Chancy(dsn, log=_quiet())
        await self.chancy.__aenter__()
        self.job = Job.from_func(noop, queue=QUEUE)
        self.conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)

    async def close(self) -> None:
        await self.chancy.__aexit__(None, None, None)
        await self.conn.close()

    async def defer_one(self, i: int) -> None:
        await self.chancy.push(self.job.with_kwargs(i=i))

    async def defer_many(self, start: int, count: int) -> None:
        extra = {} if systems.blob is None else {"blob": systems.blob}
        jobs = [self.job.with_kwargs(i=i, **extra) for i in range(start, start + count)]
        async for _ in self.chancy.push_many(jobs, batch_size=count):
            pass

    async def remaining(self) -> int:
        cur = await self.conn.execute(
            "SELECT count(*) FROM chancy_jobs WHERE state IN ('pending', 'running', 'retrying')"
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    @contextlib.asynccontextmanager
    async def worker(
        self, concurrency: int, *, poll_interval: float = 1.0, listen: bool = True
    ) -> AsyncIterator[None]:
        # The queue's concurrency and polling interval live in the database (declare upserts).
        await self.chancy.declare(
            Queue(
                QUEUE,
                concurrency=concurrency,
                executor=Chancy.Executor.Async,
                polling_interval=max(1, round(poll_interval)),
                eager_polling=True,  # fetch again as soon as a job completes
            ),
            upsert=True,
        )
        worker = Worker(self.chancy, register_signal_handlers=False, shutdown_timeout=10)
        await worker.start()
        try:
            yield
        finally:
            await worker.stop()
