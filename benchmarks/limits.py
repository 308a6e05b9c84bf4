"""Drain rate of one worker on an unlimited queue, and on limited ones (queue limits' overhead).

    python benchmarks/limits.py --dsn postgresql://postgres@127.0.0.1:5432/postgres \\
        --mode unlimited --n 20000 --concurrency 50

Creates a database of its own (dropped at the end), defers ``--n`` no-op jobs, and times
``Worker.run_until_idle``; prints one line ``RESULT {json}``. ``--mode`` is ``unlimited`` (no
settings), ``loose`` (max_running far above the concurrency: the limited claim path, never
binding), ``max_running`` (max_running = half the concurrency) or ``rate`` (a rate far above
the drain rate). Run it against an older checkout (``PYTHONPATH=...``) with ``--mode unlimited``
to compare the plain path before and after a change; interleave the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import time
from urllib.parse import urlsplit, urlunsplit

import aioq
import asyncpg

registry = aioq.Registry()


@registry.task(name="noop")
async def noop() -> None:
    """Do nothing: the drain measures the queue, not the task."""


BACKENDS = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
"""
TICKS = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float | None:
    """User+sys seconds of a local process, from /proc (None if gone or not here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


async def watch_backends(dsn: str, seen: dict[int, float], stop: asyncio.Event) -> None:
    """Record the CPU of the database's backends until ``stop`` (the last value per pid)."""
    conn = await asyncpg.connect(dsn)
    try:
        while not stop.is_set():
            for row in await conn.fetch(BACKENDS):
                cpu = _proc_cpu(row[0])
                if cpu is not None:
                    seen[row[0]] = cpu
            await asyncio.sleep(0.02)
    finally:
        await conn.close()


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def main(args: argparse.Namespace) -> dict[str, object]:
    name = f"aioq_bench_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(args.dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    dsn = urlunsplit(urlsplit(args.dsn)._replace(path=f"/{name}"))
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await aioq.install(conn)
            for statement in args.sql:
                await conn.execute(statement)
            if args.mode == "loose":
                await aioq.admin.set_queue(conn, "default", max_running=1_000_000)
            elif args.mode == "max_running":
                await aioq.admin.set_queue(conn, "default", max_running=max(1, args.concurrency // 2))
            elif args.mode == "rate":
                await aioq.admin.set_queue(conn, "default", rate=(1_000_000, 1.0))
            await conn.execute(
                "INSERT INTO aioq.jobs (task) SELECT 'noop' FROM generate_series(1, $1)", args.n
            )
            await conn.execute("VACUUM ANALYZE aioq.jobs")
        finally:
            await conn.close()
        worker = aioq.Worker(dsn=dsn, registry=registry, concurrency=args.concurrency)
        backends: dict[int, float] = {}
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(watch_backends(dsn, backends, stop))
        await asyncio.sleep(0.1)
        cpu0, started = own_cpu(), time.perf_counter()
        await worker.run_until_idle()
        seconds = time.perf_counter() - started
        worker_cpu = own_cpu() - cpu0
        stop.set()
        await watcher
        conn = await asyncpg.connect(dsn)
        try:
            left = await conn.fetchval("SELECT count(*) FROM aioq.jobs")
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    return {
        "mode": args.mode,
        "n": args.n,
        "seconds": round(seconds, 3),
        "rate": round(args.n / seconds),
        "left": left,  # jobs not drained (must be 0)
        # CPU per 1000 jobs: less at the mercy of a busy machine than the wall time. The
        # worker's includes this process's watcher; PostgreSQL's is its backends' (not WAL
        # writer or autovacuum), up to their last 20 ms sample.
        "worker_cpu_ms_per_1000": round(1e6 * worker_cpu / args.n, 1),
        "pg_cpu_ms_per_1000": round(1e6 * sum(backends.values()) / args.n, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", required=True)
    parser.add_argument(
        "--mode", choices=("unlimited", "loose", "max_running", "rate"), default="unlimited"
    )
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--sql", action="append", default=[], help="run after install")
    print("RESULT", json.dumps(asyncio.run(main(parser.parse_args()))), flush=True)
