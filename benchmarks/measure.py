"""One measurement in a fresh process; prints one line ``RESULT {json}`` (run.py starts it).

    python benchmarks/measure.py --system aioq --scenario drain --dsn ... --n 10000 --concurrency 10

Times are ``time.perf_counter`` in this process. Latency is from the return of the committing
enqueue call (autocommit: the commit is done) to the first line of the task, both measured here,
with the worker running in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import systems
import workloads
from cpu import PgCpu, tree_cpu

PRELOAD_BATCH = 1000


def rusage() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def defer_one(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    await system.open(args.dsn)
    try:
        for i in range(50):  # warm up: connections, prepared statements
            await system.defer_one(-i)
        cpu0, t0 = rusage(), time.perf_counter()
        deadline, done = t0 + args.limit, 0
        for i in range(args.n):
            await system.defer_one(i)
            done += 1
            if not i % 100 and time.perf_counter() > deadline:
                break
        seconds = time.perf_counter() - t0
        return {
            "rate": done / seconds,
            "seconds": seconds,
            "jobs": done,
            "capped": done < args.n,
            "client_cpu_ms_per_1000": 1e6 * (rusage() - cpu0) / done,
        }
    finally:
        await system.close()


async def defer_many(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    await system.open(args.dsn)
    try:
        await system.defer_many(-args.batch, args.batch)  # warm up
        cpu0, t0 = rusage(), time.perf_counter()
        for start in range(0, args.n, args.batch):
            await system.defer_many(start, min(args.batch, args.n - start))
        seconds = time.perf_counter() - t0
        return {
            "rate": args.n / seconds,
            "seconds": seconds,
            "client_cpu_ms_per_1000": 1e6 * (rusage() - cpu0) / args.n,
        }
    finally:
        await system.close()


async def preload(system: systems.System, n: int) -> None:
    for start in range(0, n, PRELOAD_BATCH):
        await system.defer_many(start, min(PRELOAD_BATCH, n - start))


async def wait_done(system: systems.System, done: asyncio.Event, deadline: float) -> bool:
    """Wait until every job ran (in-process counter), then until the database shows them done."""
    try:
        await asyncio.wait_for(done.wait(), max(0.0, deadline - time.perf_counter()))
    except TimeoutError:
        return False
    while await system.remaining():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def drain(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    if args.processes:
        return await drain_cli(system, args)
    await system.open(args.dsn)
    try:
        await preload(system, args.n)
        ran = 0
        done = asyncio.Event()

        def count(i: int) -> None:
            nonlocal ran
            ran += 1
            if ran >= args.n:
                done.set()

        systems.hook = count
        pg = await PgCpu.connect(args.dsn) if system.backend == "postgres" else None
        cpu0, t0 = rusage(), time.perf_counter()
        if pg is not None:
            await pg.start()
        async with system.worker(args.concurrency, poll_interval=args.poll):
            finished = await wait_done(system, done, t0 + args.limit)
            seconds = time.perf_counter() - t0
            worker_cpu = rusage() - cpu0
            pg_cpu = await pg.stop() if pg is not None else None
        left = await system.remaining()
        if pg is not None:
            await pg.close()
        jobs = args.n - left
        return {
            "rate": jobs / seconds,
            "seconds": seconds,
            "jobs": jobs,
            "capped": not finished,
            "worker_cpu_per_1000": 1000 * worker_cpu / max(jobs, 1),
            "pg_cpu_per_1000": 1000 * pg_cpu / max(jobs, 1) if pg_cpu is not None else None,
        }
    finally:
        await system.close()


async def drain_cli(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """aioq's own CLI with --processes: jobs committed only once both workers are up."""
    import asyncpg

    from systems.sys_aioq import noop

    conn = await asyncpg.connect(args.dsn)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": here, "AIOQ_DSN": args.dsn}
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "aioq"),
        "worker",
        "systems.sys_aioq:registry",
        "--processes",
        str(args.processes),
        "--concurrency",
        str(args.concurrency),
        "--poll-interval",
        str(args.poll),
        # As the in-process runs (no logging configured): no INFO line per job.
        "--log-level",
        "warning",
    ]
    # Warnings go to a file, never to an unread pipe (it would block).
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        tx = conn.transaction()
        await tx.start()  # the jobs are in, uncommitted, while the workers start
        for start in range(0, args.n, PRELOAD_BATCH):
            calls = [{"i": i} for i in range(start, min(start + PRELOAD_BATCH, args.n))]
            await noop.defer_many(conn, calls)
        watch = await asyncpg.connect(args.dsn)
        apps = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'aioq listener%'"
        for _ in range(600):
            if await watch.fetchval(apps) >= args.processes:
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError("the CLI workers did not start in 30 s")
        await asyncio.sleep(0.2)
        pg = await PgCpu.connect(args.dsn)
        await pg.start()
        cpu0 = tree_cpu(proc.pid)
        t0 = time.perf_counter()
        await tx.commit()  # the NOTIFY wakes both processes
        finished = False
        while time.perf_counter() < t0 + args.limit:
            if not await watch.fetchval("SELECT count(*) FROM aioq.jobs"):
                finished = True
                break
            await asyncio.sleep(0.01)
        seconds = time.perf_counter() - t0
        worker_cpu = tree_cpu(proc.pid) - cpu0
        pg_cpu = await pg.stop()
        left = await watch.fetchval("SELECT count(*) FROM aioq.jobs")
        await watch.close()
        await pg.close()
        jobs = args.n - left
        return {
            "rate": jobs / seconds,
            "seconds": seconds,
            "jobs": jobs,
            "capped": not finished,
            "worker_cpu_per_1000": 1000 * worker_cpu / max(jobs, 1),
            "pg_cpu_per_1000": 1000 * pg_cpu / max(jobs, 1) if pg_cpu is not None else None,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        await conn.close()


async def latency(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    await system.open(args.dsn)
    committed: dict[int, float] = {}
    delays: list[float] = []

    def started(i: int) -> None:
        now = time.perf_counter()
        if i in committed:
            delays.append((now - committed[i]) * 1000)
        else:  # the task started before the enqueue call returned
            delays.append(0.0)

    systems.hook = started
    try:
        async with system.worker(
            args.concurrency, poll_interval=args.poll, listen=not args.no_listen
        ):
            await asyncio.sleep(0.5)  # idle: the worker is listening and waiting
            for i in range(args.n):
                await system.defer_one(i)
                committed[i] = time.perf_counter()
                await asyncio.sleep(args.interval)
            deadline = time.perf_counter() + max(5.0, 3 * args.poll)
            while len(delays) < args.n and time.perf_counter() < deadline:
                await asyncio.sleep(0.01)
        return {"samples_ms": delays, "lost": args.n - len(delays)}
    finally:
        await system.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", required=True)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--processes", type=int, default=0)
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--no-listen", action="store_true")
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds before a drain stops")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--c50-rate", type=float, default=None, help="for the report (soak)")
    parser.add_argument("--payload-kb", type=int, default=1)
    parser.add_argument("--queues", type=int, default=1)
    args = parser.parse_args()
    if args.scenario in workloads.SCENARIOS:
        result = await workloads.SCENARIOS[args.scenario](systems.load(args.system), args)
    elif args.scenario in ("history", "soak"):
        import longrun

        result = await getattr(longrun, args.scenario)(args)
    else:
        system = systems.load(args.system)
        scenario = {"defer_one": defer_one, "defer_many": defer_many, "drain": drain}.get(
            args.scenario, latency
        )
        result = await scenario(system, args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
