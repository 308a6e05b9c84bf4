"""Defer + await-the-result round trip, one job at a time: aioq against saq and arq.

    benchmarks/.venv/bin/python benchmarks/roundtrip.py --dsn postgresql://... \\
        [--redis redis://127.0.0.1:6379/0] [--n 300] [--systems aioq,saq,arq]

Each sample is one enqueue of a job that returns a value and one wait for that value, with the
library's own calls and a worker of the library in this process; the time is from before the
enqueue to the value in hand. aioq: ``Task.defer`` + ``Task.result`` (LISTEN on the results
channel, polling as the fallback). saq: ``Queue.apply`` (enqueue, then wait on Redis pub/sub).
arq: ``enqueue_job`` + ``Job.result``, which polls Redis: with its default ``poll_delay``
(0.5 s) and with 0.01 s. Prints one ``RESULT {json}`` line per system.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any


def summary(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    return {
        "n": len(ordered),
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "mean_ms": statistics.fmean(ordered),
    }


async def measure(n: int, one: Callable[[int], Awaitable[object]]) -> list[float]:
    for i in range(20):  # warm up: connections, prepared statements, the LISTEN
        assert await one(-1 - i) == -1 - i
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        value = await one(i)
        samples.append((time.perf_counter() - t0) * 1000)
        assert value == i, (value, i)
    return samples


@contextlib.asynccontextmanager
async def aioq_system(dsn: str) -> AsyncIterator[Callable[[int], Awaitable[object]]]:
    import aioq
    import asyncpg

    registry = aioq.Registry()

    @registry.task(name="value", result_ttl=600)
    async def value(i: int) -> int:
        return i

    async with asyncpg.create_pool(dsn, min_size=2, max_size=4) as pool:
        async with pool.acquire() as conn:
            await aioq.install(conn)
        async with aioq.Worker(dsn=dsn, registry=registry, concurrency=10):
            await asyncio.sleep(0.5)

            async def one(i: int) -> object:
                async with pool.acquire() as conn:
                    job_id = await value.defer(conn, i=i)
                return await value.result(pool, job_id, timeout=30)

            yield one


@contextlib.asynccontextmanager
async def saq_system(url: str) -> AsyncIterator[Callable[[int], Awaitable[object]]]:
    from saq import Queue, Worker

    async def value(ctx: dict[str, Any], *, i: int) -> int:
        return i

    queue = Queue.from_url(url, name="roundtrip")
    await queue.connect()
    worker = Worker(queue, functions=[("value", value)], concurrency=10)
    task = asyncio.create_task(worker.start())
    await asyncio.sleep(0.5)
    try:

        async def one(i: int) -> object:
            return await queue.apply("value", timeout=30, i=i)

        yield one
    finally:
        await worker.stop()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(task, 10)
        await queue.disconnect()


def arq_system(poll_delay: float) -> Callable[[str], Any]:
    @contextlib.asynccontextmanager
    async def system(url: str) -> AsyncIterator[Callable[[int], Awaitable[object]]]:
        from arq import Worker, create_pool, func
        from arq.connections import RedisSettings

        async def value(ctx: dict[str, Any], i: int) -> int:
            return i

        redis = await create_pool(RedisSettings.from_dsn(url), default_queue_name="roundtrip")
        worker = Worker(
            functions=[func(value, name="value")],
            redis_pool=redis,
            queue_name="roundtrip",
            max_jobs=10,
            handle_signals=False,
            poll_delay=0.05,  # as in the other benchmarks: the worker's own poll
        )
        task = asyncio.create_task(worker.async_run())
        await asyncio.sleep(0.5)
        try:

            async def one(i: int) -> object:
                job = await redis.enqueue_job("value", i)
                assert job is not None
                return await job.result(timeout=30, poll_delay=poll_delay)

            yield one
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, 10)
            await worker.close()
            await redis.aclose()

    return system


SYSTEMS: dict[str, tuple[Callable[[str], Any], str]] = {
    "aioq": (aioq_system, "dsn"),
    "saq": (saq_system, "redis"),
    "arq": (arq_system(0.5), "redis"),
    "arq-poll-10ms": (arq_system(0.01), "redis"),
}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True, help="a fresh PostgreSQL database for aioq")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    for name in args.systems.split(","):
        factory, target = SYSTEMS[name]
        async with factory(args.dsn if target == "dsn" else args.redis) as one:
            samples = await measure(args.n, one)
        print("RESULT " + json.dumps({"system": name, **summary(samples)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
