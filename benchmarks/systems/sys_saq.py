"""saq (Redis): ``Queue.enqueue``, ``Worker`` in this process. saq has no bulk enqueue call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from saq import Queue, Worker

from systems import System, run_job


async def noop(ctx: dict[str, Any], *, i: int) -> None:
    """The no-op job."""
    await run_job(i)


class Adapter(System):
    name = "saq"
    backend = "redis"
    single_api = "Queue.enqueue('noop', i=...)"
    concurrency_api = "Worker(concurrency=c)"
    mapping = (
        "the number of jobs one worker runs at once (its docs); everything else its defaults "
        "(a blocking Redis pop wakes it)"
    )
    bulk_api = ""  # none: defer_many is not measured; preloads use concurrent enqueues

    async def open(self, dsn: str) -> None:
        self.queue = Queue.from_url(dsn)
        await self.queue.connect()

    async def close(self) -> None:
        await self.queue.disconnect()

    async def defer_one(self, i: int) -> None:
        await self.queue.enqueue("noop", i=i)

    async def defer_many(self, start: int, count: int) -> None:
        await asyncio.gather(
            *(self.queue.enqueue("noop", i=i) for i in range(start, start + count))
        )

    async def remaining(self) -> int:
        return await self.queue.count("incomplete")

    @contextlib.asynccontextmanager
    async def worker(
        self, concurrency: int, *, poll_interval: float = 1.0, listen: bool = True
    ) -> AsyncIterator[None]:
        worker = Worker(self.queue, functions=[noop], concurrency=concurrency)
        task = asyncio.create_task(worker.start())
        try:
            await asyncio.sleep(0.05)
            yield
        finally:
            await worker.stop()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, 10)
