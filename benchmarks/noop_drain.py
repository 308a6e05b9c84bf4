"""A no-op drain of one worker, in this process; prints one line ``RESULT {json}``.

    python benchmarks/noop_drain.py --dsn postgresql://postgres@127.0.0.1/bench --n 20000
    python benchmarks/noop_drain.py ... --limited      # the queue has a max_running (limited claim)
    python benchmarks/noop_drain.py ... --middleware   # one pass-through middleware
    python benchmarks/noop_drain.py ... --keys         # max_running_per_key, one big key + 20
    python benchmarks/noop_drain.py ... --sleep 0.05 --concurrency 1000   # I/O-bound tasks
    python benchmarks/noop_drain.py ... --prefetch 0   # a fixed claim-ahead (default: auto)
    python benchmarks/noop_drain.py ... --counts       # also count claim statements, give-backs

Run it with PYTHONPATH pointing at the checkout to measure (``ab_drain.py`` alternates two
checkouts, interleaved). The schema is (re)installed from that checkout into a fresh schema.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aioq
import asyncpg


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--limited", action="store_true")
    parser.add_argument("--middleware", action="store_true")
    parser.add_argument("--keys", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0, help="each task awaits this long")
    parser.add_argument("--prefetch", default="auto", help="'auto' or a count")
    parser.add_argument("--counts", action="store_true")
    args = parser.parse_args()
    counts = count_statements() if args.counts else {}
    conn = await asyncpg.connect(args.dsn)
    await conn.execute("DROP SCHEMA IF EXISTS aioq CASCADE")
    await aioq.install(conn)
    registry = aioq.Registry()
    options: dict[str, Any] = {}

    pause = args.sleep

    @registry.task(name="noop")
    async def noop() -> None:
        if pause:
            await asyncio.sleep(pause)

    if args.prefetch != "auto":
        options["prefetch"] = int(args.prefetch)

    if args.middleware:

        async def passthrough(job: aioq.JobContext, call_next: Any) -> Any:
            return await call_next()

        options["middleware"] = [passthrough]
    if args.keys:
        await conn.execute(
            "INSERT INTO aioq.jobs (task, args, concurrency_key)"
            " SELECT 'noop', '{}', 'big' FROM generate_series(1, $1)",
            args.n,
        )
        await conn.execute(
            "INSERT INTO aioq.jobs (task, args, concurrency_key)"
            " SELECT 'noop', '{}', 'small-' || (i % 20) FROM generate_series(1, 1000) AS i"
        )
        await aioq.admin.set_queue(conn, "default", max_running_per_key=5)
    else:
        await conn.execute(
            "INSERT INTO aioq.jobs (task, args) SELECT 'noop', '{}' FROM generate_series(1, $1)",
            args.n,
        )
    if args.limited:
        await aioq.admin.set_queue(conn, "default", max_running=10 * args.concurrency)
    await conn.execute("VACUUM ANALYZE aioq.jobs")
    worker = aioq.Worker(
        dsn=args.dsn,
        registry=registry,
        concurrency=args.concurrency,
        stats_history=False,
        vacuum_threshold=None,
        **options,
    )
    small_done = None
    if args.keys:
        small_left = "SELECT count(*) FROM aioq.jobs WHERE concurrency_key <> 'big'"
        started = time.perf_counter()
        async with worker:
            while await conn.fetchval(small_left):
                await asyncio.sleep(0.005)
            small_done = time.perf_counter() - started
            big_left = await conn.fetchval("SELECT count(*) FROM aioq.jobs")
        print("RESULT " + json.dumps({"small_done_s": small_done, "big_left": big_left}))
        await conn.close()
        return
    started = time.perf_counter()
    await worker.run_until_idle()
    seconds = time.perf_counter() - started
    left = await conn.fetchval("SELECT count(*) FROM aioq.jobs")
    assert left == 0, left
    result = {"jobs_per_s": args.n / seconds, "seconds": seconds}
    if args.sleep:
        result["of_ideal"] = args.n / seconds / (args.concurrency / args.sleep)
    print("RESULT " + json.dumps({**result, **counts}))
    await conn.close()


def count_statements() -> dict[str, int]:
    """Count the claim statements and the release outcomes written (filled in as they run)."""
    from aioq.job import OutcomeKind
    from aioq.worker.claimer import Claimer
    from aioq.worker.completer import Completer

    counts = {"claims": 0, "claimed": 0, "release_writes": 0, "released": 0}
    claim, write = Claimer.claim, Completer._write_isolating

    async def counted_claim(self: Claimer, limit: int) -> Any:
        got = await claim(self, limit)
        counts["claims"] += 1
        counts["claimed"] += len(got)
        return got

    async def counted_write(self: Completer, batch: Any) -> Any:
        released = sum(o.kind is OutcomeKind.RELEASED for o in batch)
        if released:
            counts["release_writes"] += 1
            counts["released"] += released
        return await write(self, batch)

    Claimer.claim = counted_claim  # type: ignore[method-assign]
    Completer._write_isolating = counted_write  # type: ignore[method-assign]
    return counts


if __name__ == "__main__":
    asyncio.run(main())
