"""procrastinate: ``Task.defer_async`` / ``batch_defer_async``, ``App.run_worker_async``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import psycopg
from procrastinate import App, PsycopgConnector

import systems
from systems import System, run_job


async def noop(i: int, blob: object = None) -> None:
    """The no-op job."""
    await run_job(i)


class Adapter(System):
    name = "procrastinate"
    shared_pool = True  # defer_one from many coroutines through the app's pool (max 60)
    single_api = "Task.defer_async(...)"
    bulk_api = "Task.batch_defer_async(*kwargs)"
    concurrency_api = "App.run_worker_async(concurrency=c)"
    mapping = (
        "its worker's concurrency is the number of jobs it runs at once (per worker); a "
        "PsycopgConnector pool of 4 to 60 connections; LISTEN/NOTIFY with a 1 s poll as the "
        "fallback (its default 5 s); keeps finished rows (`delete_jobs` default: never)"
    )

    async def install(self, dsn: str) -> None:
        async with App(connector=PsycopgConnector(conninfo=dsn)).open_async() as a:
            await a.schema_manager.apply_schema_async()

    async def open(self, dsn: str) -> None:
        self.dsn = dsn
        # psycopg_pool's default is 4 connections; let it grow to serve a worker at c50.
        self.app = App(connector=PsycopgConnector(conninfo=dsn, min_size=4, max_size=60))
        self.task = self.app.task(name="noop")(noop)
        await self.app.open_async()
        self.conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)

    async def close(self) -> None:
        await self.app.close_async()
        await self.conn.close()

    async def defer_one(self, i: int) -> None:
        await self.task.defer_async(i=i)

    async def defer_many(self, start: int, count: int) -> None:
        extra = {} if systems.blob is None else {"blob": systems.blob}
        await self.task.batch_defer_async(*({"i": i, **extra} for i in range(start, start + count)))

    async def remaining(self) -> int:
        cur = await self.conn.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    @contextlib.asynccontextmanager
    async def worker(
        self, concurrency: int, *, poll_interval: float = 1.0, listen: bool = True
    ) -> AsyncIterator[None]:
        task = asyncio.create_task(
            self.app.run_worker_async(
                concurrency=concurrency,
                wait=True,
                install_signal_handlers=False,
                listen_notify=listen,
                fetch_job_polling_interval=poll_interval,
            )
        )
        try:
            await asyncio.sleep(0.05)
            yield
        finally:
            task.cancel()  # procrastinate's documented way to stop a worker run as a task
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, 10)
