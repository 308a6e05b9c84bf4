"""aioq: ``Task.defer`` / ``Task.defer_many`` on an asyncpg connection, ``aioq.Worker``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aioq
import asyncpg

import systems
from systems import System, run_job

registry = aioq.Registry()


@registry.task(name="noop")
async def noop(i: int, blob: object = None) -> None:
    """The no-op job."""
    await run_job(i)


class Adapter(System):
    name = "aioq"
    single_api = "Task.defer(conn, ...)"
    bulk_api = "Task.defer_many(conn, [...])"
    concurrency_api = "Worker(concurrency=c)"
    mapping = (
        "its defaults otherwise (claim and completion batching, LISTEN/NOTIFY doorbell with "
        "polling as the fallback); deletes a finished job's row"
    )
    # The workflow scenario (workloads.workflow) runs every system whose adapter sets
    # ``workflow_api`` and implements ``run_workflow`` (systems.System.run_workflow): aioq's
    # joins it by adding both here.

    async def install(self, dsn: str) -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await aioq.install(conn)
        finally:
            await conn.close()

    async def open(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn = await asyncpg.connect(dsn)

    async def close(self) -> None:
        await self.conn.close()

    async def defer_one(self, i: int) -> None:
        await noop.defer(self.conn, i=i)  # autocommit: one transaction per job

    async def defer_many(self, start: int, count: int) -> None:
        extra = {} if systems.blob is None else {"blob": systems.blob}
        await noop.defer_many(self.conn, [{"i": i, **extra} for i in range(start, start + count)])

    async def remaining(self) -> int:
        return await self.conn.fetchval("SELECT count(*) FROM aioq.jobs")  # type: ignore[no-any-return]

    @contextlib.asynccontextmanager
    async def worker(
        self, concurrency: int, *, poll_interval: float = 1.0, listen: bool = True
    ) -> AsyncIterator[None]:
        w = aioq.Worker(
            dsn=self.dsn,
            registry=registry,
            concurrency=concurrency,
            poll_interval=poll_interval,
            listen=listen,
            shutdown_grace=5.0,
        )
        async with w:
            yield
