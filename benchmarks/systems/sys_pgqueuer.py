"""pgqueuer: ``Queries.enqueue`` (single and list form), ``QueueManager`` with an entrypoint."""

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

        # The per-entrypoint limit is pgqueuer's concurrency knob (enforced in its dequeue SQL).
        @qm.entrypoint("noop", concurrency_limit=concurrency)
        async def noop(job: Job) -> None:
            payload = job.payload or b"0"
            await run_job(int(payload) if payload[:1] != b"{" else orjson.loads(payload)["i"])

        task = asyncio.create_task(
            qm.run(
                batch_size=min(concurrency, 10),
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
