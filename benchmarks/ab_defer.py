"""The insert's cost, two checkouts (A, B) interleaved: medians of N rounds each.

    python benchmarks/ab_defer.py --a /path/to/main --b . --rounds 7

Each round runs A then B (B then A on the next round), each in a fresh process with PYTHONPATH
set to its checkout, on its own database (the schema installed by that checkout), with no
worker: the inserts' own cost, the doorbell's included (nobody on duty, as under load). Two
measures per run: ``defer_one``, sequential ``Task.defer`` calls on one connection (autocommit:
one transaction each), in microseconds per call; ``conc64``, 64 connections each deferring one
job per transaction for a few seconds, in jobs per second; and for each, the server's CPU time
per defer (its backends' user + system time from /proc: the server must run on this machine),
which a loaded machine disturbs far less than the wall-clock figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = "--child"
TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu(pids: list[int]) -> float:
    """The CPU seconds (user + system) the server's backends ``pids`` used so far."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


async def child(dsn: str, n: int, seconds: float, clients: int) -> dict[str, float]:
    import aioq
    import asyncpg

    registry = aioq.Registry()

    @registry.task(name="noop")
    async def noop(i: int) -> None: ...

    conn = await asyncpg.connect(dsn)
    await aioq.install(conn)
    await conn.execute("TRUNCATE aioq.jobs")
    for i in range(200):  # warm: prepared statements, caches
        await noop.defer(conn, i=i)
    pid = [conn.get_server_pid()]
    t0, cpu0 = time.perf_counter(), backend_cpu(pid)
    for i in range(n):
        await noop.defer(conn, i=i)
    defer_one = 1e6 * (time.perf_counter() - t0) / n
    defer_one_cpu = 1e6 * (backend_cpu(pid) - cpu0) / n
    conns = [await asyncpg.connect(dsn) for _ in range(clients)]
    for c in conns:
        await noop.defer(c, i=-1)
    counts = [0] * clients
    end = time.perf_counter() + seconds

    async def loop(k: int, c: asyncpg.Connection) -> None:
        while time.perf_counter() < end:
            await noop.defer(c, i=k)
            counts[k] += 1

    pids = [c.get_server_pid() for c in conns]
    t0, cpu0 = time.perf_counter(), backend_cpu(pids)
    await asyncio.gather(*(loop(k, c) for k, c in enumerate(conns)))
    conc = sum(counts) / (time.perf_counter() - t0)
    conc_cpu = 1e6 * (backend_cpu(pids) - cpu0) / sum(counts)
    for c in conns:
        await c.close()
    await conn.execute("TRUNCATE aioq.jobs")
    await conn.close()
    return {
        "defer_one_us": defer_one,
        "defer_one_server_cpu_us": defer_one_cpu,
        "conc64_per_s": conc,
        "conc64_server_cpu_us": conc_cpu,
    }


def once(checkout: str, dsn: str, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
    out = subprocess.run(
        [sys.executable, __file__, CHILD, dsn, str(args.n), str(args.seconds), str(args.clients)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        dsn, n, seconds, clients = (
            sys.argv[2],
            int(sys.argv[3]),
            float(sys.argv[4]),
            int(sys.argv[5]),
        )
        print(json.dumps(asyncio.run(child(dsn, n, seconds, clients))))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--n", type=int, default=3000, help="sequential defers per run")
    parser.add_argument("--seconds", type=float, default=5.0, help="of the 64-connection defer")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--base-dsn", default="postgresql://postgres@127.0.0.1:5432")
    args = parser.parse_args()
    dsns = {}
    for name in ("a", "b"):
        db = f"aioq_abdefer_{name}_{os.getpid()}"
        subprocess.run(
            ["psql", f"{args.base_dsn}/postgres", "-qc", f'CREATE DATABASE "{db}"'], check=True
        )
        dsns[name] = f"{args.base_dsn}/{db}"
    results: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    try:
        for round_ in range(args.rounds):
            order = ("a", "b") if round_ % 2 == 0 else ("b", "a")
            for name in order:
                results[name].append(once(getattr(args, name), dsns[name], args))
            a, b = results["a"][-1], results["b"][-1]
            print(
                f"round {round_}: defer_one a {a['defer_one_us']:.1f} us, b {b['defer_one_us']:.1f}"
                f" us; conc64 a {a['conc64_per_s']:.0f}/s, b {b['conc64_per_s']:.0f}/s",
                flush=True,
            )
    finally:
        for dsn in dsns.values():
            db = dsn.rsplit("/", 1)[1]
            subprocess.run(
                ["psql", f"{args.base_dsn}/postgres", "-qc", f'DROP DATABASE "{db}" WITH (FORCE)'],
                check=False,
            )
    for key in results["a"][0]:
        med = {n: statistics.median(r[key] for r in results[n]) for n in ("a", "b")}
        ratios = [b[key] / a[key] for a, b in zip(results["a"], results["b"], strict=True)]
        print(
            f"{key}: a median {med['a']:.1f}, b median {med['b']:.1f}, b/a {med['b'] / med['a']:.3f}"
            f" (median of the rounds' b/a {statistics.median(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
