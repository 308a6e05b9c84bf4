"""Job control: await a task's result, watch a job's progress, cancel running jobs.

Uses the database in AIOQ_DSN if set, otherwise starts a throwaway PostgreSQL.
Run it with `python examples/jobcontrol.py`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator

import anyio
import asyncpg

import aioq
from aioq.dev.server import EmbeddedPostgres

registry = aioq.Registry()


@registry.task(result_ttl=3600)  # keep each return value for an hour
async def total(order_id: int) -> int:
    """Sum an order; the value is stored as JSON for whoever awaits it."""
    await aioq.current_job().set_progress(0.5, note="prices fetched")
    return order_id * 100


@registry.task(result_ttl=60)
async def export(rows: int) -> int:
    """A long async job: cancelled where it awaits when someone asks."""
    job = aioq.current_job()
    for done in range(rows):
        if done % 10 == 0:
            await job.set_progress(done / rows, note=f"{done} of {rows} rows")
        await anyio.sleep(0.05)
    return rows


@registry.task(result_ttl=60)
def crunch() -> int:
    """A sync job runs in a thread, which cannot be interrupted: it polls cancel_requested."""
    job = aioq.current_job()
    rounds = 0
    while not job.cancel_requested:
        time.sleep(0.05)
        rounds += 1
    return rounds  # the job ends `cancelled` all the same


@contextlib.asynccontextmanager
async def database() -> AsyncIterator[str]:
    """Yield a DSN: AIOQ_DSN, or a throwaway server removed on exit."""
    if dsn := os.environ.get("AIOQ_DSN"):
        yield dsn
        return
    async with EmbeddedPostgres() as server:
        yield server.dsn


async def main() -> None:
    async with database() as dsn, asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        async with pool.acquire() as conn:
            await aioq.install(conn, schema=registry.schema)
            order = await total.defer(conn, order_id=7)
            long = await export.defer(conn, rows=1_000)
            spin = await crunch.defer(conn)
        async with aioq.Worker(dsn=dsn, registry=registry, concurrency=4, poll_interval=0.2):
            with anyio.fail_after(60):
                # 1. Results: wait on LISTEN (polling as the fallback), typed by the task.
                value: int = await total.result(pool, order, timeout=30)
                info = await aioq.admin.get_job(pool, order)
                assert info is not None
                print(f"1. total: {value}; status {info.status}, progress {info.progress}")

                # 2. Progress, read from another connection while the job runs.
                job = await aioq.admin.get_job(pool, long)
                while job is None or not job.progress:
                    await anyio.sleep(0.05)
                    job = await aioq.admin.get_job(pool, long)
                print(f"2. export running: {job.progress:.0%} ({job.progress_note})")

                # 3. Cancel: the worker holding each job stops it within about a second.
                states = await aioq.admin.cancel_jobs(pool, [long, spin, order])
                print(f"3. cancel_jobs: {states}")
                for job_id in (long, spin):
                    try:
                        await aioq.result(pool, job_id, timeout=30)
                    except aioq.JobCancelled as exc:
                        print(f"   {exc}")
    if states != {order: "finished", long: "cancelling", spin: "cancelling"}:
        raise SystemExit("the example did not go as expected")


if __name__ == "__main__":
    anyio.run(main)
