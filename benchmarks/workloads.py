"""Production-shaped scenarios (issue 16), each one measurement in a fresh process.

- defer_conc: ``--concurrency`` connections each deferring one job per transaction.
- io_bound: tasks that ``await asyncio.sleep(0.05)``, a preloaded backlog, one worker process.
- payload: jobs with a ``--payload-kb`` nested JSON argument: bulk defer, then a c50 drain.
- backlog, queues, processes, mixed: aioq only (see each function).
- workflow: a fan-out with one fan-in, for the systems whose adapter has ``run_workflow``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import Any

import asyncpg

import systems
from common import Memory, Runs, aioq_defer, complete, drained, pct, preload, rusage
from cpu import PgCpu, host_busy, tree_cpu

IO_SECONDS = 0.05
HERE = os.path.dirname(os.path.abspath(__file__))


async def clients(name: str, dsn: str, n: int) -> list[systems.System]:
    """``n`` opened adapters, one connection each; or one shared (its pool) n times."""
    first = systems.load(name)
    await first.open(dsn)
    if first.shared_pool:
        return [first] * n
    rest = [systems.load(name) for _ in range(n - 1)]
    await asyncio.gather(*(s.open(dsn) for s in rest))
    return [first, *rest]


async def defer_conc(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """Deferring from many connections at once, one job per transaction."""
    opened = await clients(system.name, args.dsn, args.concurrency)
    try:

        async def warm(k: int, s: systems.System) -> None:
            for j in range(5):  # prepared statements on every connection
                await s.defer_one(-(k * 10 + j))

        await asyncio.gather(*(warm(k, s) for k, s in enumerate(opened)))
        counts = [0] * len(opened)
        cpu0, t0 = rusage(), time.perf_counter()
        end = t0 + args.seconds

        async def loop(k: int, s: systems.System) -> None:
            i = k * 10_000_000
            while time.perf_counter() < end:
                await s.defer_one(i)
                i += 1
                counts[k] += 1

        await asyncio.gather(*(loop(k, s) for k, s in enumerate(opened)))
        seconds = time.perf_counter() - t0
        done = sum(counts)
        return {
            "rate": done / seconds,
            "seconds": seconds,
            "jobs": done,
            "client_cpu_ms_per_1000": 1e6 * (rusage() - cpu0) / max(done, 1),
        }
    finally:
        for s in {id(s): s for s in opened}.values():
            await s.close()


async def io_bound(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """Tasks that wait 50 ms (an HTTP call); jobs/s against concurrency / 0.05 s.

    Pickup is the time from a task's end (a slot frees) to the start of the next task, the
    ends and starts matched first-in first-out, over the saturated part of the drain.
    """
    await system.open(args.dsn)
    try:
        await preload(system, args.n)
        runs = Runs()
        ends: deque[float] = deque()
        pickup: list[float] = []

        def started(i: int) -> None:
            now = systems.clock()
            runs.count(i)
            if ends:
                pickup.append((now - ends.popleft()) * 1000)

        def finished(i: int) -> None:
            ends.append(systems.clock())

        systems.hook, systems.done_hook, systems.work_seconds = started, finished, IO_SECONDS
        pg = await PgCpu.connect(args.dsn) if system.backend == "postgres" else None
        memory = Memory()
        cpu0, t0 = rusage(), time.perf_counter()
        if pg is not None:
            await pg.start()
        async with system.worker(args.concurrency, poll_interval=args.poll), memory.watch(system):
            if system.consuming_since is not None:
                t0 = system.consuming_since
            finished_all = await runs.wait(args.n, t0 + args.limit)
            await asyncio.sleep(IO_SECONDS)  # the last tasks finish
            seconds = time.perf_counter() - t0 - IO_SECONDS
            own = system.worker_cpu()
            worker_cpu = rusage() - cpu0 if own is None else own - system.cpu_at_start
            pg_cpu = await pg.stop() if pg is not None else None
        if pg is not None:
            await pg.close()
        jobs = runs.n
        ideal = args.concurrency / IO_SECONDS
        # Saturated: leave out the first wave (no slot had freed yet) and the tail.
        tail = int(len(pickup) * 0.95)
        saturated = pickup[: max(tail, 1)]
        return {
            **drained(jobs, seconds, finished_all, worker_cpu, pg_cpu),
            "ideal": ideal,
            "of_ideal": jobs / seconds / ideal,
            "pickup_ms_p50": pct(saturated, 0.5),
            "pickup_ms_p99": pct(saturated, 0.99),
            **memory.figures(),
        }
    finally:
        await system.close()


def blob_of(kb: int) -> object:
    """A nested JSON value of about ``kb`` KiB once encoded."""
    item = {"id": 12345, "name": "item name", "tags": ["a", "bb", "ccc"], "price": 12.5}
    per = len('{"id":12345,"name":"item name","tags":["a","bb","ccc"],"price":12.5},')
    return {"order": {"lines": [dict(item, id=k) for k in range(max(1, kb * 1024 // per))]}}


async def payload(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """Bulk defer of jobs with a big argument, then a c50 drain of them.

    Each phase stops at ``--limit`` seconds (a slow peer defers and drains fewer than ``--n``).
    """
    systems.blob = blob_of(args.payload_kb)
    batch = 1000 if args.payload_kb <= 4 else 50
    await system.open(args.dsn)
    try:
        cpu0, t0 = rusage(), time.perf_counter()
        n = await preload(system, args.n, batch, t0 + args.limit)
        defer_s, defer_cpu = time.perf_counter() - t0, rusage() - cpu0
        runs = Runs()
        systems.hook = runs.count
        cpu0, t0 = rusage(), time.perf_counter()
        async with system.worker(50, poll_interval=args.poll):
            finished = await runs.wait(n, t0 + args.limit)
            seconds = time.perf_counter() - t0
            worker_cpu = rusage() - cpu0
        return {
            "deferred": n,
            "defer_rate": n / defer_s,
            "defer_mb_s": n * args.payload_kb / 1024 / defer_s,
            "defer_cpu_ms_per_job": 1000 * defer_cpu / n,
            "rate": runs.n / seconds,
            "capped": not finished or n < args.n,
            "worker_cpu_ms_per_job": 1000 * worker_cpu / max(runs.n, 1),
        }
    finally:
        await system.close()


async def _claim_times(conn: asyncpg.Connection, queues: list[str], n: int) -> list[float]:
    """Claim one ready job and complete it, ``n`` times; the claim round trips in ms."""
    from aioq.sql.jobs import CLAIM_ONE_QUEUE, CLAIM_QUEUES, ClaimJobs, ClaimQueues

    out = []
    for k in range(n):
        t0 = time.perf_counter()
        if len(queues) == 1:
            one = ClaimJobs(queue=queues[0], limit=1, worker="bench", unknown=[], grace=0)
            claims = await CLAIM_ONE_QUEUE.rows(conn, "aioq", one)
        else:
            many = ClaimQueues(queues=queues, limit=1, worker="bench", unknown=[], grace=0)
            claims = await CLAIM_QUEUES.rows(conn, "aioq", many)
        out.append((time.perf_counter() - t0) * 1000)
        if not claims:  # every caller leaves more ready jobs than it claims
            raise RuntimeError(f"claim {k + 1} of {n} found no ready job in {queues[:3]}")
        await complete(conn, claims[0])
    return out


async def backlog(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """aioq with ``--n`` pending jobs, a quarter ready and the rest scheduled an hour ahead.

    Claim round trips (one job, then its completion) with a 1 000-job backlog, then at the
    start of the big one, then after a c50 worker drained the ready part down to 1 000 (or
    ``--limit`` seconds passed: ``ready_at_end`` says how far it got).
    """
    conn = await asyncpg.connect(args.dsn)
    try:
        claims, warm = 300, 50
        await aioq_defer(conn, 1000 + claims + warm)
        await conn.execute("ANALYZE aioq.jobs")
        # Untimed claims first: the connection's prepared statements and the fresh database's
        # first writes would otherwise weigh on the small backlog's figure alone.
        await _claim_times(conn, ["default"], warm)
        small = await _claim_times(conn, ["default"], claims)
        await conn.execute("DELETE FROM aioq.jobs")
        await conn.execute("VACUUM ANALYZE aioq.jobs")
        ready = args.n // 4
        t0 = time.perf_counter()
        await aioq_defer(conn, ready)
        await aioq_defer(conn, args.n - ready, start=ready, delay=3600)
        defer_s = time.perf_counter() - t0
        aioq_cli = os.path.join(os.path.dirname(sys.executable), "aioq")
        t0 = time.perf_counter()
        subprocess.run(
            [aioq_cli, "stats", "--dsn", args.dsn], check=True, capture_output=True, cwd=HERE
        )
        stats_s = time.perf_counter() - t0
        start = await _claim_times(conn, ["default"], claims)
        # Drain the ready part down to 1 000 with the worker, then time the claim again.
        adapter = systems.load("aioq")
        await adapter.open(args.dsn)
        left_ready = "SELECT count(*) FROM aioq.jobs WHERE status = 'pending' AND run_at <= now()"
        memory = Memory()
        t0 = time.perf_counter()
        async with adapter.worker(50, poll_interval=1.0), memory.watch(adapter):
            while await conn.fetchval(left_ready) > 1000 + claims:
                if time.perf_counter() - t0 > args.limit:
                    break
                await asyncio.sleep(0.2)
        drain_s = time.perf_counter() - t0
        await adapter.close()
        # The worker overshoots the target while it stops: top the ready jobs up to 1 000 plus
        # the claims (new rows at the far end of the index, past the drained part's dead ones).
        now_ready = await conn.fetchval(left_ready)
        await aioq_defer(conn, max(0, 1000 + claims - now_ready), start=args.n)
        end = await _claim_times(conn, ["default"], claims)
        return {
            "jobs": args.n,
            "ready": ready,
            "ready_at_end": max(now_ready, 1000 + claims) - claims,
            "defer_many_s": defer_s,
            "defer_rate": args.n / defer_s,
            "stats_s": stats_s,
            "drain_rate": (ready - claims - now_ready) / drain_s,
            **{f"small_ms_p{q}": pct(small, q / 100) for q in (50, 99)},
            **{f"start_ms_p{q}": pct(start, q / 100) for q in (50, 99)},
            **{f"end_ms_p{q}": pct(end, q / 100) for q in (50, 99)},
            **memory.figures(),
        }
    finally:
        await conn.close()


async def queues(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """aioq: claim round trips and a c50 drain with jobs spread over ``--queues`` queues."""
    import aioq

    from systems.sys_aioq import registry

    names = [f"q{k}" for k in range(args.queues)]
    conn = await asyncpg.connect(args.dsn)
    try:
        claims = 300
        per = (args.n + claims) // len(names) + 1
        for name in names:
            await aioq_defer(conn, per, queue=name)
        await conn.execute("ANALYZE aioq.jobs")
        claim = await _claim_times(conn, names, claims)
        runs = Runs()
        systems.hook = runs.count
        cpu0, t0 = rusage(), time.perf_counter()
        worker = aioq.Worker(dsn=args.dsn, registry=registry, queues=names, concurrency=50)
        async with worker:
            finished = await runs.wait(args.n, t0 + args.limit)
            seconds = time.perf_counter() - t0
            worker_cpu = rusage() - cpu0
        return {
            "claim_ms_p50": pct(claim, 0.5),
            "claim_ms_p99": pct(claim, 0.99),
            "rate": runs.n / seconds,
            "capped": not finished,
            "worker_cpu_per_1000": 1000 * worker_cpu / max(runs.n, 1),
        }
    finally:
        await conn.close()


WAL_AND_LOCKS = """
SELECT (SELECT count(*) FROM pg_stat_activity
        WHERE datname = current_database() AND wait_event_type = 'Lock') AS lock_waits,
       (SELECT count(*) FROM pg_stat_activity
        WHERE datname = current_database() AND wait_event_type = 'LWLock') AS lwlock_waits,
       (SELECT count(*) FROM aioq.jobs) AS remaining
"""


def aioq_worker_cmd(processes: int, concurrency: int, poll: float) -> list[str]:
    """The ``aioq worker`` command line of the benchmark's registry (run with PYTHONPATH=HERE)."""
    return [
        os.path.join(os.path.dirname(sys.executable), "aioq"),
        "worker",
        "systems.sys_aioq:registry",
        *["--processes", str(processes), "--concurrency", str(concurrency)],
        *["--poll-interval", str(poll)],
        # As the in-process runs (no logging configured): no INFO line per job.
        *["--log-level", "warning"],
    ]


async def processes(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """``aioq worker --processes N``: jobs/s, CPU of workers and backends, lock waits, WAL/job.

    The jobs are inserted in a transaction that commits once every process listens; the clock
    starts at that commit. Lock waits are sampled every 10 ms from pg_stat_activity (sessions
    of this database waiting on a heavyweight lock or an LWLock); WAL is the LSN difference
    over the drain. The drain scenario's ``--processes`` cells are this measurement too.
    """
    conn = await asyncpg.connect(args.dsn)
    env = {**os.environ, "PYTHONPATH": HERE, "AIOQ_DSN": args.dsn}
    cmd = aioq_worker_cmd(args.processes, args.concurrency, args.poll)
    # Warnings go to a file, never to an unread pipe (it would block).
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    watch = await asyncpg.connect(args.dsn)
    try:
        tx = conn.transaction()
        await tx.start()  # the jobs are in, uncommitted, while the workers start
        await aioq_defer(conn, args.n, batch=1000)
        apps = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'aioq listener%'"
        for _ in range(600):
            if await watch.fetchval(apps) >= args.processes:
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError("the CLI workers did not start in 30 s")
        await asyncio.sleep(0.3)
        pg = await PgCpu.connect(args.dsn)
        await pg.start()
        cpu0, host0 = tree_cpu(proc.pid), host_busy()
        lsn0 = await watch.fetchval("SELECT pg_current_wal_lsn()")
        t0 = time.perf_counter()
        await tx.commit()  # the NOTIFY wakes every process
        samples, lock_waits, lwlock_waits, finished = 0, 0, 0, False
        while time.perf_counter() < t0 + args.limit:
            row = await watch.fetchrow(WAL_AND_LOCKS)
            samples += 1
            lock_waits += row["lock_waits"]
            lwlock_waits += row["lwlock_waits"]
            if not row["remaining"]:
                finished = True
                break
            await asyncio.sleep(0.01)
        seconds = time.perf_counter() - t0
        worker_cpu, host = tree_cpu(proc.pid) - cpu0, host_busy() - host0
        pg_cpu = await pg.stop()
        wal = await watch.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", lsn0)
        left = await watch.fetchval("SELECT count(*) FROM aioq.jobs")
        await pg.close()
        jobs = args.n - left
        return {
            **drained(jobs, seconds, finished, worker_cpu, pg_cpu),
            "cores": os.cpu_count(),
            "pg_cpu_share": pg_cpu / (pg_cpu + worker_cpu) if pg_cpu else None,
            "pg_cores_busy": pg_cpu / seconds if pg_cpu is not None else None,
            "worker_cores_busy": worker_cpu / seconds,
            "host_cores_busy": host / seconds,
            "lock_waits_avg": lock_waits / max(samples, 1),
            "lwlock_waits_avg": lwlock_waits / max(samples, 1),
            "wal_bytes_per_job": float(wal) / max(jobs, 1),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        await watch.close()
        await conn.close()


async def mixed(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """aioq: a ``--n`` backlog drains (c50) while jobs are deferred for ``--seconds``.

    The worker first drains the backlog alone for 3 s: half that rate is the deferring rate
    (measured in this cell, on this machine's load). Latency is commit-to-start of the
    steadily deferred jobs (not of the backlog); the table's row count is sampled every second.
    """
    conn = await asyncpg.connect(args.dsn)
    try:
        await aioq_defer(conn, args.n)
        committed: dict[int, float] = {}
        latency: list[float] = []
        runs = Runs()

        def started(i: int) -> None:
            runs.count(i)
            if i >= 10_000_000 and i in committed:
                latency.append((time.perf_counter() - committed.pop(i)) * 1000)

        systems.hook = started
        rows: list[int] = []
        adapter = systems.load("aioq")
        await adapter.open(args.dsn)
        async with adapter.worker(50, poll_interval=1.0):
            t0 = time.perf_counter()
            await asyncio.sleep(3.0)
            drain_rate = runs.n / (time.perf_counter() - t0)
            args.rate = 0.5 * drain_rate
            t0 = time.perf_counter()
            i, tick = 10_000_000, 0.02
            next_t, next_sample = t0, t0
            while time.perf_counter() < t0 + args.seconds:
                due = int((time.perf_counter() - t0) * args.rate) - (i - 10_000_000)
                if due > 0:
                    await aioq_defer(conn, due, start=i)
                    now = time.perf_counter()
                    committed.update(dict.fromkeys(range(i, i + due), now))
                    i += due
                if time.perf_counter() >= next_sample:
                    rows.append(await conn.fetchval("SELECT count(*) FROM aioq.jobs"))
                    next_sample += 1.0
                next_t += tick
                await asyncio.sleep(max(0.0, next_t - time.perf_counter()))
            enqueued = i - 10_000_000
        await adapter.close()
        return {
            "enqueue_rate": enqueued / args.seconds,
            "target_rate": args.rate,
            "drain_rate": drain_rate,
            "backlog": args.n,
            "p50_ms": pct(latency, 0.5),
            "p99_ms": pct(latency, 0.99),
            "started_steady": len(latency),
            "enqueued": enqueued,
            "max_rows": max(rows) if rows else None,
            "rows_series": rows,
        }
    finally:
        await conn.close()


async def workflow(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """A fan-out of ``--n`` steps with one fan-in (``System.run_workflow``), the worker at
    ``--concurrency``: the time from the submit call to the fan-in's start, per step.

    The worker idles for 0.5 s first. CPU is the submitting process's and the worker's (one
    process, or this one plus the worker's processes), not the database's or the broker's.
    """
    await system.open(args.dsn)
    try:
        runs = Runs()
        reached = asyncio.Event()
        fan_in: dict[str, float] = {}

        def started(i: int) -> None:
            if i == systems.FAN_IN:
                fan_in.update(at=systems.clock(), steps_before=runs.n)
                reached.set()
            else:
                runs.count(i)

        systems.hook = started
        memory = Memory()
        async with system.worker(args.concurrency, poll_interval=args.poll), memory.watch(system):
            await asyncio.sleep(0.5)
            own0, cpu0 = system.worker_cpu() or 0.0, rusage()
            t0 = time.perf_counter()
            await system.run_workflow(args.n)
            submit_s = time.perf_counter() - t0
            try:
                await asyncio.wait_for(
                    reached.wait(), max(0.0, t0 + args.limit - time.perf_counter())
                )
            except TimeoutError:
                return {
                    "error": f"no fan-in in {args.limit:.0f} s ({runs.n} of {args.n} steps ran)"
                }
            cpu = rusage() - cpu0 + (system.worker_cpu() or 0.0) - own0
        seconds = fan_in["at"] - t0
        return {
            "steps": args.n,
            "seconds": seconds,
            "rate": args.n / seconds,
            "us_per_step": 1e6 * seconds / args.n,
            "submit_s": submit_s,
            "steps_before_fan_in": int(fan_in["steps_before"]),
            "cpu_us_per_step": 1e6 * cpu / args.n,
            **memory.figures(),
        }
    finally:
        await system.close()


async def typed(system: systems.System, args: argparse.Namespace) -> dict[str, Any]:
    """Typed arguments (a 10-field dataclass, a pydantic model) against the same JSON as a dict:
    defer_many, then a drain at c50, in this process (typed_values.py)."""
    import typed_values

    return await typed_values.measure(args.dsn, args.shape, args.n, args.batch, args.concurrency)


SCENARIOS = {
    "typed": typed,
    "defer_conc": defer_conc,
    "io_bound": io_bound,
    "payload": payload,
    "backlog": backlog,
    "queues": queues,
    "processes": processes,
    "mixed": mixed,
    "workflow": workflow,
}
