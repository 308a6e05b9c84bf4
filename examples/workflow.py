"""A workflow: fetch, split into parts processed in parallel, merge once they all succeeded.

Uses the database in AIOQ_DSN if set, otherwise starts a throwaway PostgreSQL.
Run it with `python examples/workflow.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import asyncpg

import aioq
from aioq.dev.server import EmbeddedPostgres

registry = aioq.Registry()


@registry.task
async def extract(day: str) -> list[int]:
    """The first step: its return value is kept for the steps that depend on it."""
    return list(range(1, 101))


@registry.task
async def transform(part: int, parts: int) -> int:
    """One of the fan-out's steps: reads its dependency's result through upstream()."""
    rows: list[int] = (await aioq.current_job().upstream())["extract"]
    return sum(rows[part::parts])


@registry.task
async def load(day: str) -> int:
    """The fan-in: runs once, after every transform succeeded, and sees all their results."""
    totals = await aioq.current_job().upstream()
    total: int = sum(totals.values())
    print(f"load: {len(totals)} parts for {day}, total {total}")
    return total


@registry.task
async def notify(day: str) -> None:
    print(f"notify: report for {day} ready")


@contextlib.asynccontextmanager
async def database() -> AsyncIterator[str]:
    """Yield a DSN: AIOQ_DSN, or a throwaway server removed on exit."""
    if dsn := os.environ.get("AIOQ_DSN"):
        yield dsn
        return
    async with EmbeddedPostgres() as server:
        yield server.dsn


async def main() -> None:
    day, parts = "2026-12-01", 10
    async with database() as dsn:
        conn = await asyncpg.connect(dsn)
        await aioq.install(conn, schema=registry.schema)
        flow = aioq.Workflow("nightly-report")
        raw = flow.add(extract.call(day=day))
        steps = [flow.add(transform.call(part=i, parts=parts), after=[raw]) for i in range(parts)]
        merged = flow.add(load.call(day=day), after=steps, name="load")
        flow.add(notify.call(day=day), after=[merged])
        async with conn.transaction():  # every step commits with the caller's work, or none
            run = await flow.defer(conn)
        print(f"deferred run {run.id}: {len(run.jobs)} steps")
        await aioq.Worker(dsn=dsn, registry=registry, poll_interval=0.2).run_until_idle()
        info = await aioq.workflow(conn, run.id)
        assert info is not None
        print(
            f"run {info.id} {info.name}: {info.state}, {info.counts['succeeded']} steps succeeded"
        )
        await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
