"""Time the dashboard's pages on an empty jobs table and on a big one (default 10 million rows).

    python benchmarks/dashboard.py --dsn postgresql://postgres@127.0.0.1:5432/postgres [--rows N]

Creates a database of its own next to the DSN's, fills it with generate_series (mostly ready
jobs, some scheduled, dead and running, a rare queue), times each page (median of 5 requests
through Starlette's TestClient), and drops the database. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time
from urllib.parse import urlsplit, urlunsplit

import aioq
import aioq.web
import asyncpg
from starlette.testclient import TestClient

PAGES = (
    "/",
    "/live",
    "/jobs",
    "/jobs?before=5000000",
    "/jobs?status=dead",
    "/jobs?queue=rare",
    "/jobs?q=timeout",
    "/jobs/4242",
    "/throughput?range=day",
)


def fill_sql(rows: int) -> list[str]:
    dead, running, scheduled = rows // 50, 200, rows // 20
    return [
        f"""INSERT INTO aioq.jobs (queue, task, run_at)
            SELECT 'q' || (i % 4), 'tasks.t' || (i % 30), now() - interval '1 hour'
            FROM generate_series(1, {rows - dead - running - scheduled - 10}) AS i""",
        f"""INSERT INTO aioq.jobs (queue, task, run_at)
            SELECT 'q' || (i % 4), 'tasks.later', now() + interval '1 day'
            FROM generate_series(1, {scheduled}) AS i""",
        f"""INSERT INTO aioq.jobs (queue, task, status, attempts, last_error)
            SELECT 'q' || (i % 4), 'tasks.t' || (i % 30), 'dead', 5,
                   CASE WHEN i % 1000 = 0 THEN 'TimeoutError: took too long' ELSE 'ValueError: ' || i END
            FROM generate_series(1, {dead}) AS i""",
        f"""INSERT INTO aioq.jobs (queue, task, status, attempts, locked_by, locked_at,
                                   lease_expires_at)
            SELECT 'q' || (i % 4), 'tasks.t1', 'running', 1, 'w' || (i % 8), now(),
                   now() + interval '5 minutes'
            FROM generate_series(1, {running}) AS i""",
        "INSERT INTO aioq.jobs (queue, task) SELECT 'rare', 'tasks.r' FROM generate_series(1, 10)",
        "VACUUM ANALYZE aioq.jobs",
    ]


def time_pages(dsn: str) -> dict[str, float]:
    timings = {}
    with TestClient(aioq.web.app(dsn=dsn, statement_timeout=30)) as client:
        for path in PAGES:
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                response = client.get(path)
                samples.append(time.perf_counter() - start)
                assert response.status_code in (200, 404), (path, response.status_code)
            timings[path] = statistics.median(samples)
    return timings


async def run(admin_dsn: str, rows: int) -> None:
    name = f"aioq_dashboard_bench_{secrets.token_hex(4)}"
    dsn = urlunsplit(urlsplit(admin_dsn)._replace(path=f"/{name}"))
    admin = await asyncpg.connect(admin_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        conn = await asyncpg.connect(dsn)
        await aioq.install(conn)
        empty = await asyncio.to_thread(time_pages, dsn)
        start = time.perf_counter()
        for statement in fill_sql(rows):
            await conn.execute(statement, timeout=None)
        filled = time.perf_counter() - start
        count = await conn.fetchval("SELECT count(*) FROM aioq.jobs", timeout=None)
        size = await conn.fetchval("SELECT pg_size_pretty(pg_total_relation_size('aioq.jobs'))")
        await conn.close()
        big = await asyncio.to_thread(time_pages, dsn)
        print(f"jobs table: {count:,} rows, {size} with indexes (filled in {filled:.0f}s)")
        print(f"{'page':<26}{'empty':>10}{'big':>10}   (median of 5, ms)")
        for path in PAGES:
            print(f"{path:<26}{empty[path] * 1000:>10.1f}{big[path] * 1000:>10.1f}")
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True, help="a DSN allowed to create databases")
    parser.add_argument("--rows", type=int, default=10_000_000)
    args = parser.parse_args()
    asyncio.run(run(args.dsn, args.rows))


if __name__ == "__main__":
    main()
