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


@registry.task(name="fan_in")
async def fan_in() -> None:
    """The workflow's fan-in: runs once every step succeeded."""
    await run_job(systems.FAN_IN)


class Adapter(System):
    name = "aioq"
    single_api = "Task.defer(conn, ...)"
    bulk_api = "Task.defer_many(conn, [...])"
    concurrency_api = "Worker(concurrency=c)"
    mapping = (
        "its defaults otherwise (claim and completion batching, LISTEN/NOTIFY doorbell with "
        "polling as the fallback); deletes a finished job's row"
    )
    workflow_api = (
        "Workflow.add(noop.call(i=i)) x n, add(fan_in.call(), after=steps), defer(conn)"
        " in one transaction"
    )

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

    async def run_workflow(self, n: int) -> None:
        """Defer the run: ``n`` steps and the fan-in after them all, in one transaction (one
        round trip for the run, one per 4 000 steps)."""
        flow = aioq.Workflow("bench")
        steps = [flow.add(noop.call(i=i)) for i in range(n)]
        flow.add(fan_in.call(), after=steps, name="fan_in")
        async with self.conn.transaction():
            await flow.defer(self.conn)

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
