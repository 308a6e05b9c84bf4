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
import time
from typing import Any

import systems
import workloads
from common import Memory, Runs, drained, preload, rusage
from cpu import PgCpu


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
        await preload(system, args.n, args.batch)
        seconds = time.perf_counter() - t0
        return {
            "rate": args.n / seconds,
            "seconds": seconds,
            "client_cpu_ms_per_1000": 1e6 * (rusage() - cpu0) / args.n,
        }
    finally:
        await system.close()


async def wait_done(system: systems.System, runs: Runs, n: int, deadline: float) -> bool:
    """Wait until every job ran (in-process counter), then until the database shows them done."""
    if not await runs.wait(n, deadline):
        return False
    while await system.remaining():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def drain(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    if args.processes:  # aioq's CLI: the processes scenario's measurement
        return await workloads.processes(system, args)
    await system.open(args.dsn)
    try:
        await preload(system, args.n)
        runs = Runs()
        systems.hook = runs.count
        pg = await PgCpu.connect(args.dsn) if system.backend == "postgres" else None
        memory = Memory()
        cpu0, t0 = rusage(), time.perf_counter()
        if pg is not None:
            await pg.start()
        async with system.worker(args.concurrency, poll_interval=args.poll), memory.watch(system):
            if system.consuming_since is not None:  # a worker process, told to start just now
                t0 = system.consuming_since
            finished = await wait_done(system, runs, args.n, t0 + args.limit)
            seconds = time.perf_counter() - t0
            worker_cpu = worker_cpu_since(system, cpu0)
            pg_cpu = await pg.stop() if pg is not None else None
        left = await system.remaining()
        if pg is not None:
            await pg.close()
        return {**drained(args.n - left, seconds, finished, worker_cpu, pg_cpu), **memory.figures()}
    finally:
        await system.close()


def worker_cpu_since(system: systems.System, cpu0: float) -> float:
    """The worker's CPU seconds: this process's since ``cpu0``, or its own processes' since
    they were told to start."""
    own = system.worker_cpu()
    return rusage() - cpu0 if own is None else own - system.cpu_at_start


async def latency(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    await system.open(args.dsn)
    committed: dict[int, float] = {}
    delays: list[float] = []

    def started(i: int) -> None:
        now = systems.clock()
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
    parser.add_argument("--shape", default="plain", help="typed: plain, dataclass or pydantic")
    args = parser.parse_args()
    if args.scenario == "install":  # run.py's provisioning, in this system's interpreter
        await systems.load(args.system).install(args.dsn)
        result: dict[str, Any] = {"installed": args.system}
    elif args.scenario in workloads.SCENARIOS:
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
