"""pgqueuer: ``Queries.enqueue`` (single and list form), ``QueueManager`` with an entrypoint.

Concurrency is ``QueueManager.run(max_concurrent_tasks=c)``: its documented hard cap on this
worker's picked jobs (a per-worker cap, as aioq's ``concurrency``), with its default
``batch_size=10`` (at most c // 2: it requires ``max_concurrent_tasks >= 2 * batch_size``).
The entrypoint's ``concurrency_limit`` is another thing: a limit across every worker, which its
dequeue statement enforces by counting the entrypoint's picked jobs; it is left unlimited, except
at c = 1, which ``max_concurrent_tasks`` cannot express (it would need ``batch_size`` 0.5):
there ``concurrency_limit=1`` with ``batch_size=1``, its documented way to serialise dispatch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import orjson
from pgqueuer import AsyncpgDriver, Queries, QueueManager
from pgqueuer.models import Job

import systems
from systems import System, run_job


class Adapter(System):
    name = "pgqueuer"
    single_api = "Queries.enqueue(entrypoint, payload)"
    bulk_api = "Queries.enqueue([entrypoints], [payloads], [priorities])"
    concurrency_api = (
        "QueueManager.run(max_concurrent_tasks=c, batch_size=min(10, c // 2)); at c = 1"
        " entrypoint concurrency_limit=1, batch_size=1"
    )
    mapping = (
        "one asyncpg connection for the QueueManager; LISTEN/NOTIFY with its dequeue timeout "
        "(the poll) as the fallback; acks and heartbeats buffered (its defaults); deletes a "
        "finished job's row (keeps a log row)"
    )

    async def install(self, dsn: str) -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await Queries(AsyncpgDriver(conn)).install()
        finally:
            await conn.close()

    async def open(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn = await asyncpg.connect(dsn)
        self.queries = Queries(AsyncpgDriver(self.conn))

    async def close(self) -> None:
        await self.conn.close()

    async def defer_one(self, i: int) -> None:
        await self.queries.enqueue("noop", str(i).encode())

    async def defer_many(self, start: int, count: int) -> None:
        if systems.blob is None:
            payloads = [str(i).encode() for i in range(start, start + count)]
        else:
            payloads = [
                orjson.dumps({"i": i, "blob": systems.blob}) for i in range(start, start + count)
            ]
        await self.queries.enqueue(["noop"] * count, payloads, [0] * count)

    async def remaining(self) -> int:
        return await self.conn.fetchval("SELECT count(*) FROM pgqueuer")  # type: ignore[no-any-return]

    @contextlib.asynccontextmanager
    async def worker(
        self, concurrency: int, *, poll_interval: float = 1.0, listen: bool = True
    ) -> AsyncIterator[None]:
        conn = await asyncpg.connect(self.dsn)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        serial = concurrency < 2  # max_concurrent_tasks needs at least 2 x batch_size

        @qm.entrypoint("noop", concurrency_limit=1 if serial else 0)
        async def noop(job: Job) -> None:
            payload = job.payload or b"0"
            await run_job(int(payload) if payload[:1] != b"{" else orjson.loads(payload)["i"])

        task = asyncio.create_task(
            qm.run(
                batch_size=1 if serial else min(10, concurrency // 2),
                max_concurrent_tasks=None if serial else concurrency,
                dequeue_timeout=timedelta(seconds=poll_interval),
            )
        )
        try:
            await asyncio.sleep(0.05)  # let it LISTEN before jobs arrive
            yield
        finally:
            qm.shutdown.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(task, 10)
            await conn.close()
