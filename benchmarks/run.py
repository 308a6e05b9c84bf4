"""The benchmark orchestrator: ``make bench`` runs it in benchmarks/.venv.

Provisions one database per system (a template with the schema, copied fresh for every
measurement), runs each measurement as its own process under a timeout (measure.py,
longrun.py, ceiling.py), systems interleaved (A B C A B C ...), R repeats, and writes
RESULTS.md, results.json and the charts through report.py (next to ``--out``: benchmarks/).

    benchmarks/.venv/bin/python benchmarks/run.py [--quick] [--repeats 3]
        [--only defer_one,drain] [--systems aioq,pgqueuer] [--dsn postgresql://...]

The server is a throwaway one with PostgreSQL's stock settings (fsync, synchronous_commit and
autovacuum on: what production runs), started for the run, unless --dsn / $AIOQ_BENCH_DSN
names another; RESULTS.md states the settings of the server used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import envs  # noqa: E402
import report  # noqa: E402
import systems  # noqa: E402
from plan import Cell, plan  # noqa: E402

SCENARIOS = (
    "defer_one",
    "defer_many",
    "defer_conc",
    "drain",
    "io_bound",
    "payload",
    "latency",
    "history",
    "backlog",
    "queues",
    "processes",
    "mixed",
    "soak",
    "ceiling",
    "workflow",
    "typed",
)
REDIS_PORT = 6379


@dataclass
class Env:
    admin_dsn: str
    redis_url: str | None
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    kept: set[str] = field(default_factory=set)
    # Interpreters of the systems whose cells run outside the benchmark venv (envs.py).
    python: dict[str, str] = field(default_factory=dict)

    def dsn(self, db: str) -> str:
        return with_db(self.admin_dsn, db)


def with_db(dsn: str, db: str) -> str:
    """Replace the database of a postgresql:// URL."""
    head, _, tail = dsn.partition("?")
    base = head.rsplit("/", 1)[0] if head.count("/") > 2 else head
    return f"{base}/{db}" + (f"?{tail}" if tail else "")


@contextlib.contextmanager
def postgres(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """Yield (admin DSN, where it came from): --dsn / AIOQ_BENCH_DSN, else a throwaway server.

    Not a development server found at :5432: those often run with fsync or autovacuum off,
    which flatters every system and hides what vacuum costs.
    """
    dsn = args.dsn or os.environ.get("AIOQ_BENCH_DSN")
    if dsn:
        yield dsn, "AIOQ_BENCH_DSN / --dsn"
        return
    from aioq.dev.server import EmbeddedPostgres

    server = EmbeddedPostgres()
    server.start()
    try:
        yield (
            server.dsn,
            "aioq.dev.server.EmbeddedPostgres (a throwaway server started for the run, "
            "PostgreSQL's stock settings)",
        )
    finally:
        server.stop()


def _ping(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis(env: Env) -> Iterator[None]:
    """Use $AIOQ_BENCH_REDIS or Redis at 127.0.0.1:6379, or start redis-server on a free port,
    or skip the Redis peers (with the reason)."""
    given = os.environ.get("AIOQ_BENCH_REDIS")
    if given:
        host, _, port = given.removeprefix("redis://").split("/")[0].partition(":")
        if _ping(int(port or REDIS_PORT), host or "127.0.0.1"):
            env.redis_url = given.rstrip("/")
            env.notes.append(f"Redis: {given} ($AIOQ_BENCH_REDIS)")
        else:
            for name in systems.REDIS:
                env.skipped[name] = f"no Redis answers at $AIOQ_BENCH_REDIS ({given})"
        yield
        return
    if _ping(REDIS_PORT):
        env.redis_url = f"redis://127.0.0.1:{REDIS_PORT}"
        yield
        return
    exe = shutil.which("redis-server")
    if exe is None:
        for name in systems.REDIS:
            env.skipped[name] = "no Redis at 127.0.0.1:6379 and no redis-server on PATH"
        env.redis_url = None
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            if _ping(port):
                break
            time.sleep(0.05)
        env.redis_url = f"redis://127.0.0.1:{port}"
        env.notes.append(f"Redis: a redis-server started for the run on port {port}")
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def interpreters(env: Env, names: list[str]) -> None:
    """Build (or reuse) the venvs of the systems that need their own; skip those that fail."""
    for name in names:
        if name in envs.VENVS and name not in env.skipped:
            exe, why = envs.python_for(name)
            if exe is None:
                env.skipped[name] = why
            else:
                env.python[name] = exe


async def provision(env: Env, names: list[str]) -> None:
    """Create bench_<name>_tpl with each system's schema; a failing system is skipped."""
    admin = await asyncpg.connect(env.admin_dsn)
    try:
        for name in names:
            if name in env.skipped:
                continue
            system = systems.load(name)
            if system.backend != "postgres":
                continue
            tpl = f"bench_{name}_tpl"
            await admin.execute(f'DROP DATABASE IF EXISTS "bench_{name}" WITH (FORCE)')
            await admin.execute(f'DROP DATABASE IF EXISTS "{tpl}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{tpl}"')
            try:
                if name in env.python:  # the library is in its own venv: install from there
                    install_in(env.python[name], name, env.dsn(tpl))
                else:
                    await system.install(env.dsn(tpl))
            except Exception as exc:  # a peer that cannot install is skipped, with the reason
                env.skipped[name] = f"schema install failed: {type(exc).__name__}: {exc}"
    finally:
        await admin.close()


def install_in(python: str, name: str, dsn: str) -> None:
    """Install a system's schema with measure.py in the system's own interpreter."""
    cmd = [python, os.path.join(HERE, "measure.py"), "--system", name, "--scenario", "install"]
    out = subprocess.run([*cmd, "--dsn", dsn], capture_output=True, text=True, cwd=HERE)
    if out.returncode != 0:
        raise RuntimeError((out.stderr.strip().splitlines() or ["no output"])[-1][:300])


async def copy_template(env: Env, name: str, db: str) -> str:
    """A fresh copy of the system's template database, named ``db``; return its DSN."""
    admin = await asyncpg.connect(env.admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{db}" TEMPLATE "bench_{name}_tpl"')
    finally:
        await admin.close()
    return env.dsn(db)


def flush_redis(url: str, db: int) -> None:
    import redis as redis_client

    redis_client.Redis.from_url(url, db=db).flushdb()


def run_cell(env: Env, cell: Cell) -> dict[str, Any]:
    """Run one measurement in a fresh process; return its parsed result (or an error)."""
    if cell.db == "redis":
        assert env.redis_url is not None
        flush_redis(env.redis_url, cell.redis_db)
        dsn = f"{env.redis_url}/{cell.redis_db}"
    elif cell.db == "embedded":
        return run_embedded(env, cell)
    elif cell.db == "keep":  # the history databases persist across repeats (made once per run)
        db = f"bench_{cell.system}_{cell.label}"
        if db not in env.kept:
            asyncio.run(copy_template(env, cell.system, db))
            env.kept.add(db)
        dsn = env.dsn(db)
    else:
        dsn = asyncio.run(copy_template(env, cell.system, f"bench_{cell.system}"))
    python = env.python.get(cell.system, sys.executable)
    cmd = [python, os.path.join(HERE, cell.script), "--dsn", dsn, *cell.argv]
    started = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=cell.timeout, cwd=HERE)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {cell.timeout:.0f} s"}
    wall = time.perf_counter() - started
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            result["wall_s"] = wall
            return result
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {out.returncode}: {tail[:300]}"}


STARTUP_S = 3.0  # a cell's process start, imports and preload, roughly
COPY_S = 0.5  # the fresh database copy before each cell, roughly


def rounds(cell: Cell, repeats: int) -> int:
    """How many rounds a cell runs: the run's repeats, at most the cell's own cap."""
    return min(repeats, cell.rounds or repeats)


def expected(cell: Cell, last: dict[str, list[dict[str, Any]]]) -> float:
    """Seconds a cell should take: its median in the last results.json, at most its time limits."""
    key = cell.key()
    walls = [
        r["wall_s"]
        for r in last.get(cell.scenario, [])
        if "wall_s" in r and all(r.get(k) == v for k, v in key.items())
    ]
    limits = [float(v) for f, v in itertools.pairwise(cell.argv) if f in ("--limit", "--seconds")]
    phases = 2 if cell.scenario == "payload" else 1  # a limit for the defer and for the drain
    bound = phases * sum(limits) + STARTUP_S if limits else float("inf")
    if not walls and "n" in key:  # the same cell with another N: its overhead, N at its rate
        same = [
            r
            for r in last.get(cell.scenario, [])
            if r.get("rate") and r.get("seconds") and "wall_s" in r
            if all(r.get(k) == v for k, v in key.items() if k != "n")
        ]
        if same:
            overhead = statistics.median(r["wall_s"] - r["seconds"] for r in same)
            rate = statistics.median(r["rate"] for r in same)
            return COPY_S + min(overhead + key["n"] / rate, bound)
    if not walls:  # a cell new to the plan: its limits, or 10 s
        return COPY_S + (bound if limits else 10.0)
    return COPY_S + min(statistics.median(walls), bound)


def apis(names: list[str]) -> dict[str, dict[str, str]]:
    loaded = [systems.load(n) for n in [*names, systems.REFERENCE]]
    return {
        "single": {s.name: s.single_api for s in loaded},
        "bulk": {s.name: s.bulk_api for s in loaded},
        "concurrency": {s.name: s.concurrency_api for s in loaded},
        "mapping": {s.name: s.mapping for s in loaded},
        "workflow": {s.name: s.workflow_api for s in loaded if s.workflow_api},
    }


def autovacuum_on(dsn: str) -> bool:
    async def ask() -> bool:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetchval("SHOW autovacuum") == "on"  # type: ignore[no-any-return]
        finally:
            await conn.close()

    return asyncio.run(ask())


def run_embedded(env: Env, cell: Cell) -> dict[str, Any]:
    """Run a cell on a throwaway stock server (the soak, when the main one has autovacuum off)."""
    from aioq.dev.server import EmbeddedPostgres

    with EmbeddedPostgres() as server:
        admin = Env(admin_dsn=server.dsn, redis_url=None, python=env.python)
        asyncio.run(provision(admin, [cell.system]))
        cell = Cell(**{**cell.__dict__, "db": "fresh"})
        result = run_cell(admin, cell)
    result["server"] = "aioq.dev.server.EmbeddedPostgres (stock settings: autovacuum on)"
    return result


def versions(env: Env) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("aioq-pg", "asyncpg", "pgqueuer", "procrastinate", "chancy", "saq", "arq"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    for name, python in env.python.items():  # the peers in venvs of their own
        ask = "import platform; from importlib.metadata import version as v;"
        ask += f" print(v({name!r}), platform.python_version())"
        got = subprocess.run([python, "-c", ask], capture_output=True, text=True)
        if got.returncode == 0:
            dist, py = got.stdout.split()
            out[name] = f"{dist} (Python {py}, its own venv)"
    return out


async def server_info(env: Env) -> dict[str, str]:
    conn = await asyncpg.connect(env.admin_dsn)
    try:
        info = {"postgres": await conn.fetchval("SHOW server_version")}
        for name in (
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "autovacuum",
            "shared_buffers",
            "max_connections",
        ):
            info[name] = await conn.fetchval(f"SHOW {name}")
        return info
    finally:
        await conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer jobs and repeats")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="scenarios, comma-separated")
    parser.add_argument("--systems", default=",".join(systems.ALL), help="comma-separated")
    parser.add_argument(
        "--dsn",
        help="an admin DSN (default: $AIOQ_BENCH_DSN, else a throwaway server with stock settings)",
    )
    parser.add_argument(
        "--out",
        default=os.path.join(HERE, "RESULTS.md"),
        help="RESULTS.md to write; results.json and charts/ go next to it",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other scenarios of results.json (with --only: re-run some, report all)",
    )
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    scenarios = [s for s in args.only.split(",") if s]
    names = [s for s in args.systems.split(",") if s]
    for bad in set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenario {bad!r}; choose from {', '.join(SCENARIOS)}")
    for bad in set(names) - set(systems.ALL):
        parser.error(f"unknown system {bad!r}; choose from {', '.join(systems.ALL)}")
    if "aioq" not in names:
        names.insert(0, "aioq")
    command = " ".join(["benchmarks/run.py", *sys.argv[1:]])
    began, load = time.time(), os.getloadavg()[0]
    with postgres(args) as (admin_dsn, pg_source):
        env = Env(admin_dsn=admin_dsn, redis_url=None)
        env.notes.append(f"Server used: {pg_source}")
        with redis(env):
            interpreters(env, names)
            asyncio.run(provision(env, [*names, systems.REFERENCE]))
            for name, why in env.skipped.items():
                if name in names:
                    print(f"skipping {name}: {why}", flush=True)
            active = [n for n in names if n not in env.skipped]
            results: dict[str, list[dict[str, Any]]] = {}
            last = {}
            if os.path.exists(os.path.join(HERE, "results.json")):
                with open(os.path.join(HERE, "results.json")) as f:
                    last = json.load(f)["results"]
            estimate = {
                s: sum(
                    rounds(c, repeats) * expected(c, last)
                    for c in plan(s, active, quick=args.quick, prior={})
                )
                for s in scenarios
            }
            print(
                f"estimate: about {sum(estimate.values()) / 60:.0f} min (each cell's time in the"
                " last results.json, at most its limits)",
                flush=True,
            )
            for done, scenario in enumerate(scenarios, 1):
                cells = plan(scenario, active, quick=args.quick, prior=results)
                if scenario in ("soak", "mixed") and not autovacuum_on(env.admin_dsn):
                    # A soak shows whether autovacuum keeps up: not on a server that has it off.
                    for cell in cells:
                        cell.db = "embedded"
                    env.notes.append(
                        f"The {scenario} ran on a throwaway stock server"
                        " (aioq.dev.server.EmbeddedPostgres): the main server has autovacuum = off"
                    )
                t0 = time.perf_counter()
                most = max((rounds(c, repeats) for c in cells), default=0)
                for rep in range(most):
                    # Each round starts further along the list: no cell always runs first
                    # (after the database copies) or last.
                    now = [c for c in cells if rep < rounds(c, repeats)]
                    shift = rep * len(now) // most
                    for cell in now[shift:] + now[:shift]:
                        result = run_cell(env, cell)
                        result.update(cell.key(), repeat=rep)
                        results.setdefault(scenario, []).append(result)
                        print(
                            f"  {scenario} {cell.title()} #{rep + 1}: {report.brief(result)}",
                            flush=True,
                        )
                left = sum(estimate[s] for s in scenarios[done:])
                print(
                    f"{scenario}: {time.perf_counter() - t0:.0f} s (estimated"
                    f" {estimate[scenario]:.0f} s); {(time.time() - began) / 60:.1f} min so far,"
                    f" about {left / 60:.0f} min to go",
                    flush=True,
                )
            meta = {
                "command": command,
                "repeats": repeats,
                "quick": args.quick,
                "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
                "minutes": (time.time() - began) / 60,
                "machine": report.machine(),
                "load": f"{load:.2f}, {os.getloadavg()[0]:.2f}",
                "versions": versions(env),
                "server": asyncio.run(server_info(env)),
                "skipped": {k: v for k, v in env.skipped.items() if k in names},
                "notes": env.notes,
                "apis": apis(names),
            }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    saved = os.path.join(os.path.dirname(os.path.abspath(args.out)), "results.json")
    if args.merge and os.path.exists(saved):
        with open(saved) as f:
            old = json.load(f)
        earlier = old["meta"].get("scenario_runs", {})
        runs = {s: earlier.get(s, old["meta"]["started"]) for s in old["results"]}
        for scenario, rows in old["results"].items():
            results.setdefault(scenario, rows)
        runs.update(dict.fromkeys(scenarios, meta["started"]))
        meta["scenario_runs"] = runs
        before = f"(scenarios run {old['meta']['started']}) "
        meta["notes"] = [f"(scenarios run {meta['started']}) {n}" for n in meta["notes"]] + [
            n if n.startswith("(") else before + n for n in old["meta"]["notes"]
        ]
    data = {"meta": meta, "results": results}
    with open(saved, "w") as f:
        json.dump(data, f, indent=1)
    report.write(data, args.out)
    print(f"wrote {args.out} in {meta['minutes']:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
