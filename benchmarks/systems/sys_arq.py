"""arq (Redis): ``ArqRedis.enqueue_job``, ``Worker`` in this process. arq has no bulk call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from arq import Worker, create_pool
from arq.connections import RedisSettings
from arq.constants import default_queue_name

from systems import System, run_job


async def noop(ctx: dict[str, Any], i: int) -> None:
    """The no-op job."""
    await run_job(i)


class Adapter(System):
    name = "arq"
    backend = "redis"
    single_api = "ArqRedis.enqueue_job('noop', i)"
    concurrency_api = "Worker(max_jobs=c)"
    mapping = (
        "`max_jobs` is the number of jobs one worker runs at once (its docs); it polls Redis "
        "every `poll_delay` (0.05 s here, its default 0.5 s)"
    )
    bulk_api = ""  # none: defer_many is not measured; preloads use concurrent enqueues

    async def open(self, dsn: str) -> None:
        self.settings = RedisSettings.from_dsn(dsn)
        self.redis = await create_pool(self.settings)

    async def close(self) -> None:
        await self.redis.aclose()

    async def defer_one(self, i: int) -> None:
        await self.redis.enqueue_job("noop", i)

    async def defer_many(self, start: int, count: int) -> None:
        await asyncio.gather(
            *(self.redis.enqueue_job("noop", i) for i in range(start, start + count))
        )

    async def remaining(self) -> int:
        return await self.redis.zcard(default_queue_name)  # a job leaves the queue when done

    @contextlib.asynccontextmanager
    async def worker(
        self, concurrency: int, *, poll_interval: float = 1.0, listen: bool = True
    ) -> AsyncIterator[None]:
        worker = Worker(
            functions=[noop],
            redis_pool=self.redis,
            max_jobs=concurrency,
            handle_signals=False,
            # arq polls Redis (default every 0.5 s, and after a batch): 0.05 s gives it a fair chance.
            poll_delay=0.05,
        )
        task = asyncio.create_task(worker.async_run())
        try:
            await asyncio.sleep(0.05)
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, 10)
            try:
                await worker.close()
            except asyncio.CancelledError:
                # A drain stopped at its limit: close() cancels the jobs still running and lets
                # one of their CancelledErrors out. Only a cancellation of this task goes on.
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
