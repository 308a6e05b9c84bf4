"""aioq's history and soak scenarios (called from measure.py in a fresh process)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import time
from typing import Any

import asyncpg
from aioq.sql.jobs import CLAIM_ONE_QUEUE, ClaimJobs

import systems
from common import Histogram, Runs, aioq_defer, complete, pct, resident, slope_mb_per_min
from systems.sys_aioq import Adapter, noop

TABLE = """
SELECT s.n_live_tup, s.n_dead_tup, s.autovacuum_count, pg_table_size('aioq.jobs') AS table_bytes,
       pg_indexes_size('aioq.jobs') AS index_bytes
FROM pg_stat_user_tables AS s WHERE s.relid = 'aioq.jobs'::regclass
"""

ADD_HISTORY = """
INSERT INTO aioq.jobs (queue, task, args, status, run_at, attempts, last_error, created_at)
SELECT 'default', 'noop', jsonb_build_object('i', g), 'dead', now() - interval '1 day', 5,
       'RuntimeError: a failure kept as history', now() - interval '1 day'
FROM generate_series(1, $1) AS g
"""


# The jobs still pending or running, through the two partial indexes that hold them: a
# `status <> 'dead'` count is a (parallel) sequential scan of the whole table, 100-130 ms with
# 1 000 000 dead rows on a 2-core machine, polled every 5 ms at the end of the timed drain and
# competing with the worker for both cores (it was part of the history scenario's 1.47x).
LIVE_JOBS = """
SELECT (SELECT count(*) FROM aioq.jobs WHERE status = 'pending')
     + (SELECT count(*) FROM aioq.jobs WHERE status = 'running')
"""


async def history(args: argparse.Namespace) -> dict[str, Any]:
    """Claim round trip and drain rate with ``--rows`` dead jobs in the hot table."""
    conn = await asyncpg.connect(args.dsn)
    have = await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE status = 'dead'")
    if have < args.rows:  # built once per run; the database persists across repeats
        await conn.execute(ADD_HISTORY, args.rows - have)
        await conn.execute("VACUUM ANALYZE aioq.jobs")
        # The bulk insert's WAL triggers checkpoints; without one now, the timed updates below
        # would pay full-page writes that the small-history run does not.
        with contextlib.suppress(asyncpg.PostgresError):
            await conn.execute("CHECKPOINT")
    claims = 500
    await aioq_defer(conn, args.n + claims, batch=1000)
    await conn.execute("ANALYZE aioq.jobs")
    claim = ClaimJobs(queue="default", limit=1, worker="bench", unknown=[], grace=0)
    plan = await conn.fetch("EXPLAIN " + CLAIM_ONE_QUEUE.text("aioq"), *CLAIM_ONE_QUEUE.values(claim))
    plan_text = "\n".join(r[0] for r in plan)
    claim_ms, complete_ms = [], []
    for _ in range(claims):
        t0 = time.perf_counter()
        (c,) = await CLAIM_ONE_QUEUE.rows(conn, "aioq", claim)
        t1 = time.perf_counter()
        await complete(conn, c)
        complete_ms.append((time.perf_counter() - t1) * 1000)
        claim_ms.append((t1 - t0) * 1000)
    adapter = Adapter()
    await adapter.open(args.dsn)
    runs = Runs()
    systems.hook = runs.count
    t0 = time.perf_counter()
    async with adapter.worker(args.concurrency):
        if not await runs.wait(args.n, t0 + 120):
            raise TimeoutError(f"{runs.n} of {args.n} jobs ran in 120 s")
        while await conn.fetchval(LIVE_JOBS):
            await asyncio.sleep(0.005)
        seconds = time.perf_counter() - t0
    await adapter.close()
    await conn.close()
    return {
        "claim_ms_p50": statistics.median(claim_ms),
        "claim_ms_p95": pct(claim_ms, 0.95),
        "complete_ms_p50": statistics.median(complete_ms),
        "rate": args.n / seconds,
        "uses_claim_index": "jobs_claim_idx" in plan_text,
        "plan": plan_text,
    }


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    """``--rate`` jobs/s for ``--seconds`` (a bulk defer every 20 ms) into an in-process worker."""
    adapter = Adapter()
    await adapter.open(args.dsn)
    watch = await asyncpg.connect(args.dsn)
    tick = 0.02
    per_tick = max(1, round(args.rate * tick))
    committed: dict[int, float] = {}
    window: list[float] = []
    all_ms = Histogram()  # the whole run's: fixed memory (a list would grow by a float a job)
    done = 0

    def started(i: int) -> None:
        nonlocal done
        done += 1
        # The NOTIFY can start a job before the enqueuer's defer_many call has returned.
        t = committed.get(i)
        ms = (time.perf_counter() - t) * 1000 if t is not None else 0.0
        window.append(ms)
        all_ms.add(ms)

    systems.hook = started
    warnings = Warnings()
    logging.getLogger("aioq").addHandler(warnings)
    series: list[dict[str, Any]] = []
    stop = asyncio.Event()

    async def enqueue() -> None:
        start, k = time.perf_counter(), 0
        while not stop.is_set():
            await noop.defer_many(adapter.conn, [{"i": k}] * per_tick)
            committed[k] = time.perf_counter()
            k += 1
            await asyncio.sleep(max(0.0, start + k * tick - time.perf_counter()))

    async def sample(t: float, enq: int) -> None:
        row = await watch.fetchrow(TABLE)
        backlog = await watch.fetchval("SELECT count(*) FROM aioq.jobs")
        series.append(
            {
                "t": round(t, 1),
                "enqueued": enq,
                "done": done,
                "backlog": backlog,
                "p50_ms": pct(window, 0.5),
                "p99_ms": pct(window, 0.99),
                # The worker's process (the enqueuer shares it): resident MiB.
                "rss_mb": resident([]),
                **dict(row),
            }
        )
        window.clear()

    async with adapter.worker(args.concurrency):
        t0 = time.perf_counter()
        producer = asyncio.create_task(enqueue())
        for s in range(1, int(args.seconds) + 1):
            await asyncio.sleep(max(0.0, t0 + s - time.perf_counter()))
            await sample(time.perf_counter() - t0, len(committed) * per_tick)
        stop.set()
        await producer
        enqueued = len(committed) * per_tick
        elapsed = time.perf_counter() - t0
        deadline = time.perf_counter() + 30
        while done < enqueued and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        await sample(time.perf_counter() - t0, enqueued)
    await adapter.close()
    await watch.close()
    # Flat over time: the slope of RSS over the second half of the steady part (the first half
    # holds the start-up: connections, statement caches, the first allocations).
    steady = [(x["t"], x["rss_mb"]) for x in series[:-1]]
    second = steady[len(steady) // 2 :]
    return {
        "target_rate": args.rate,
        "rss_mb_first": steady[0][1] if steady else None,
        "rss_mb_last": steady[-1][1] if steady else None,
        "rss_mb_peak": max((m for _, m in steady), default=None),
        "rss_slope_mb_min": slope_mb_per_min(second),
        "rss_second_half_s": second[-1][0] - second[0][0] if len(second) > 1 else None,
        "c50_rate": args.c50_rate,
        "enqueue_rate": enqueued / elapsed,
        "done": done,
        "enqueued": enqueued,
        "p50_ms": all_ms.pct(0.5),
        "p99_ms": all_ms.pct(0.99),
        "runs_per_job": done / max(enqueued, 1),
        "autovacuum": await autovacuum(args.dsn),
        "warnings": warnings.counts,
        "series": series,
    }


class Warnings(logging.Handler):
    """Counts aioq's warnings and errors by message shape (reaper rescues, lost leases)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.name}: {record.msg}"
        self.counts[key] = self.counts.get(key, 0) + 1


async def autovacuum(dsn: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum', 'autovacuum_naptime')"
        )
        return {r["name"]: r["setting"] for r in rows}
    finally:
        await conn.close()
