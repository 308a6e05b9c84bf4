"""The soak: one ``aioq worker --concurrency 50`` fed at a steady rate by an enqueuer of its own.

    python benchmarks/soak.py run --minutes 10 [--fraction 0.7 | --rate N] [--autovacuum off]
                                  [--mix realistic|noop] [--out DIR] [--dsn DSN]

On a throwaway stock PostgreSQL (aioq.dev.server.EmbeddedPostgres: fsync on, autovacuum on
unless ``--autovacuum off``), or the server of ``--dsn`` (a database of its own is created
there). First the capacity: a 150 000-job backlog of no-op jobs drained by the same worker
command (skipped with ``--rate``). Then ``--fraction`` of it is deferred by a second process
(``soak.py enqueue``: a ``defer_many`` every 20 ms) for ``--minutes``, into a third (the worker,
``aioq worker soak_tasks``). Every ``--sample`` seconds the harness writes one line to
``DIR/series.jsonl``: enqueued and started jobs, the backlog, the worker's claim and pickup
percentiles over the interval (benchmarks/soak_tasks.py), the size of every aioq table and
index, dead tuples, vacuum and autovacuum counts, vacuums in progress, the worker's RSS and the
server's CPU. ``DIR/summary.json`` holds the verdicts, ``DIR/*.png`` the charts.

The realistic mix (``--mix realistic``): per 100 jobs, 80 no-ops, 9 that fail once and succeed
on their retry, 1 that fails three times and ends dead (pruned after a minute by the worker's
``--dead-retention``), 10 whose result is kept for a minute; a workflow of 10 steps and a fan-in
every second (runs pruned after two minutes), and a periodic job every second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import psutil

HERE = Path(__file__).resolve().parent
TICK = 0.02  # the enqueuer's period: one defer_many per task every 20 ms
CONCURRENCY = 50
CAPACITY_JOBS = 150_000
AIOQ_PATH = ""  # --aioq: the directory holding the aioq package the worker runs

SIZES = """
SELECT c.relname AS name, c.relkind AS kind, pg_relation_size(c.oid) AS bytes
FROM pg_class AS c
WHERE c.relnamespace = 'aioq'::regnamespace AND c.relkind IN ('r', 'i')
"""
TABLES = """
SELECT relname AS name, n_live_tup, n_dead_tup, vacuum_count, autovacuum_count,
       analyze_count, autoanalyze_count, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
FROM pg_stat_user_tables WHERE schemaname = 'aioq'
"""
INDEXES = """
SELECT i.indexrelname AS name, i.idx_scan, i.idx_tup_read, i.idx_tup_fetch,
       io.idx_blks_hit + io.idx_blks_read AS idx_blks
FROM pg_stat_user_indexes AS i JOIN pg_statio_user_indexes AS io USING (indexrelid)
WHERE i.schemaname = 'aioq'
"""
ACTIVITY = """
SELECT (SELECT count(*) FROM pg_stat_progress_vacuum AS p
        WHERE p.relid = 'aioq.jobs'::regclass) AS vacuuming_jobs,
       (SELECT count(*) FROM pg_stat_activity
        WHERE backend_type = 'autovacuum worker') AS autovacuum_workers,
       (SELECT extract(epoch FROM max(now() - xact_start))::float8 FROM pg_stat_activity
        WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid()
          AND backend_type = 'client backend') AS oldest_xact_s,
       (SELECT last_value FROM aioq.jobs_id_seq) AS job_ids,
       (SELECT reltuples FROM pg_class WHERE oid = 'aioq.jobs'::regclass) AS jobs_reltuples,
       (SELECT relpages FROM pg_class WHERE oid = 'aioq.jobs'::regclass) AS jobs_relpages
"""

# What the server's sessions are doing (the longest first): a stall shows here.
BUSY = """
SELECT pid, backend_type, state, wait_event_type, wait_event,
       extract(epoch FROM now() - query_start)::float8 AS seconds,
       regexp_replace(left(query, 100), '\\s+', ' ', 'g') AS query
FROM pg_stat_activity
WHERE pid <> pg_backend_pid() AND state IS DISTINCT FROM 'idle'
  AND backend_type IN ('client backend', 'autovacuum worker')
ORDER BY query_start
"""


# ---------------------------------------------------------------- the enqueuer (its own process)


async def enqueue(args: argparse.Namespace) -> None:
    """Defer ``--rate`` jobs/s for ``--seconds``; one JSON line of counts a second to ``--out``."""
    sys.path.insert(0, str(HERE))
    import aioq

    import soak_tasks as t

    conn = await asyncpg.connect(args.dsn)
    per_tick = args.rate * TICK
    rng = random.Random(args.seed)
    owed = 0.0
    enqueued = 0
    flows = 0
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    start = time.perf_counter()
    next_report = 1.0
    next_flow = 1.0
    behind_max = 0.0
    with open(args.out, "ab", buffering=0) as out:
        k = 0
        while not stop.is_set():
            elapsed = time.perf_counter() - start
            if elapsed >= args.seconds:
                break
            owed += per_tick
            n = int(owed)
            owed -= n
            now = time.time()
            if args.mix == "noop":
                if n:
                    await t.noop.defer_many(conn, [{"t": now}] * n)
            else:
                noop, retried, dead, kept = [], [], [], []
                for _ in range(n):
                    x = rng.random()
                    if x < 0.80:
                        noop.append({"t": now})
                    elif x < 0.89:
                        retried.append({"t": now, "fails": 1})
                    elif x < 0.90:
                        dead.append({"t": now, "fails": 3})
                    else:
                        kept.append({"t": now})
                if noop:
                    await t.noop.defer_many(conn, noop)
                if retried or dead:
                    await t.flaky.defer_many(conn, retried + dead)
                if kept:
                    await t.keep.defer_many(conn, kept)
                if elapsed >= next_flow:
                    flow = aioq.Workflow("soak")
                    steps = [flow.add(t.step.call(t=now, i=i)) for i in range(10)]
                    flow.add(t.step.call(t=now, i=10), after=steps, name="fan_in")
                    async with conn.transaction():
                        await flow.defer(conn)
                    n += 11
                    flows += 1
                    next_flow += 1.0
            enqueued += n
            k += 1
            behind = time.perf_counter() - (start + k * TICK)
            behind_max = max(behind_max, behind)
            if elapsed >= next_report:
                line = {"at": time.time(), "enqueued": enqueued, "behind_s": behind_max}
                out.write(json.dumps(line).encode() + b"\n")
                behind_max = 0.0
                next_report += 1.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, -behind))
        line = {"at": time.time(), "enqueued": enqueued, "behind_s": behind_max, "end": True}
        out.write(json.dumps(line).encode() + b"\n")
    await conn.close()


# ---------------------------------------------------------------- the harness


class Tail:
    """The last complete JSON line of a file another process appends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.last: dict[str, Any] = {}
        self.lines: list[dict[str, Any]] = []

    def read(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.last
        end = data.rfind(b"\n")
        if end < 0:
            return self.last
        self.offset += end + 1
        for raw in data[: end + 1].splitlines():
            self.last = json.loads(raw)
            self.lines.append(self.last)
        return self.last


def read_count(stats: Path) -> int:
    """The worker's count of jobs started, at most 20 ms old."""
    try:
        return int(Path(str(stats) + ".count").read_bytes() or b"0")
    except FileNotFoundError:
        return 0


def server_cpu(postmaster: psutil.Process | None) -> float | None:
    """CPU seconds of the whole server: the postmaster, its exited children (autovacuum
    workers, ended backends) and the live ones."""
    if postmaster is None:
        return None
    try:
        t = postmaster.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for child in postmaster.children():
            with contextlib.suppress(psutil.Error):
                c = child.cpu_times()
                total += c.user + c.system
    except psutil.Error:
        return None
    return total


def worker_command(dsn: str, extra: list[str]) -> list[str]:
    exe = Path(sys.executable).with_name("aioq")
    return [
        str(exe),
        "worker",
        "soak_tasks",
        "--dsn",
        dsn,
        "--concurrency",
        str(CONCURRENCY),
        "--log-level",
        "warning",
        *extra,
    ]


def start_worker(
    dsn: str, stats: Path, extra: list[str], log: Path, interval: float
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "AIOQ_SOAK_STATS": str(stats), "AIOQ_SOAK_INTERVAL": str(interval)}
    if AIOQ_PATH:  # another copy of aioq (a before/after comparison)
        env["PYTHONPATH"] = AIOQ_PATH
    with open(log, "ab") as out:
        return subprocess.Popen(
            worker_command(dsn, extra), cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT
        )


def stop(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


async def wait_started(tail: Tail, proc: subprocess.Popen[bytes], within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not tail.read():
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited ({proc.returncode}) before it reported")
        if time.monotonic() > deadline:
            raise TimeoutError("the worker did not report within a minute")
        await asyncio.sleep(0.05)


async def new_database(admin_dsn: str, name: str) -> str:
    import aioq

    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    dsn = admin_dsn.rsplit("/", 1)[0] + "/" + name
    conn = await asyncpg.connect(dsn)
    try:
        await aioq.install(conn)
    finally:
        await conn.close()
    return dsn


async def capacity(admin_dsn: str, out: Path, mix: str) -> float:
    """Jobs/s at which the worker drains a backlog of the mix's jobs (between 10 % and 90 % of
    their first attempts started; the retries of the failing ones come after)."""
    sys.path.insert(0, str(HERE))
    import soak_tasks as t

    dsn = await new_database(admin_dsn, "aioq_soak_capacity")
    conn = await asyncpg.connect(dsn)
    now = time.time()
    for _ in range(CAPACITY_JOBS // 10_000):
        if mix == "noop":
            await t.noop.defer_many(conn, [{"t": now}] * 10_000)
        else:  # the mix's proportions (see enqueue)
            await t.noop.defer_many(conn, [{"t": now}] * 8_000)
            await t.flaky.defer_many(conn, [{"t": now, "fails": 1}] * 900)
            await t.flaky.defer_many(conn, [{"t": now, "fails": 3}] * 100)
            await t.keep.defer_many(conn, [{"t": now}] * 1_000)
    await conn.execute("VACUUM ANALYZE aioq.jobs")
    await conn.close()
    stats = out / "capacity_worker.jsonl"
    tail = Tail(stats)
    proc = start_worker(dsn, stats, [], out / "capacity_worker.log", 0.25)
    try:
        await wait_started(tail, proc)
        points: list[tuple[float, int]] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            last = tail.read()
            if not points or points[-1][0] != last["at"]:
                points.append((last["at"], last["started"]))
            if last["started"] >= CAPACITY_JOBS:
                break
            await asyncio.sleep(0.25)
    finally:
        stop(proc)
    lo = next(p for p in points if p[1] >= 0.1 * CAPACITY_JOBS)
    hi = next(p for p in points if p[1] >= 0.9 * CAPACITY_JOBS)
    return (hi[1] - lo[1]) / (hi[0] - lo[0])


async def sample(conn: asyncpg.Connection) -> dict[str, Any]:
    sizes = {r["name"]: r["bytes"] for r in await conn.fetch(SIZES)}
    tables = {r["name"]: dict(r) for r in await conn.fetch(TABLES)}
    indexes = {r["name"]: dict(r) for r in await conn.fetch(INDEXES)}
    activity = dict(await conn.fetchrow(ACTIVITY))
    busy = [dict(r) for r in await conn.fetch(BUSY)]
    return {"sizes": sizes, "tables": tables, "indexes": indexes, "busy": busy, **activity}


async def soak(
    args: argparse.Namespace, admin_dsn: str, postmaster: psutil.Process | None
) -> dict[str, Any]:
    out = Path(args.out).resolve()  # the worker runs in benchmarks/
    out.mkdir(parents=True, exist_ok=True)
    if args.rate:
        cap, rate = None, args.rate
    else:
        cap = args.capacity or await capacity(admin_dsn, out, args.mix)
        rate = args.fraction * cap
    print(f"capacity {cap and round(cap)} jobs/s; deferring {rate:.0f} jobs/s", flush=True)
    dsn = await new_database(admin_dsn, "aioq_soak")
    worker_stats, enq_stats = out / "worker.jsonl", out / "enqueuer.jsonl"
    for f in (worker_stats, enq_stats, out / "series.jsonl", Path(f"{worker_stats}.count")):
        f.unlink(missing_ok=True)
    extra = []
    if args.mix == "realistic":
        extra = ["--dead-retention", "60", "--workflow-retention", "120"]
    wtail, etail = Tail(worker_stats), Tail(enq_stats)
    worker = start_worker(dsn, worker_stats, extra, out / "worker.log", args.sample)
    seconds = args.minutes * 60
    conn = await asyncpg.connect(dsn)
    series: list[dict[str, Any]] = []
    enqueuer: subprocess.Popen[bytes] | None = None
    try:
        await wait_started(wtail, worker)
        wproc = psutil.Process(worker.pid)
        enqueuer = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "enqueue",
                "--dsn",
                dsn,
                "--rate",
                str(rate),
                "--seconds",
                str(seconds),
                "--mix",
                args.mix,
                "--out",
                str(enq_stats),
            ]
        )
        t0 = time.monotonic()
        cpu0 = server_cpu(postmaster)
        wcpu0 = sum(wproc.cpu_times()[:2])
        with open(out / "series.jsonl", "w") as lines:
            k = 0
            drained_at = None
            dumps = 0
            while True:
                k += 1
                await asyncio.sleep(max(0.0, t0 + k * args.sample - time.monotonic()))
                now = time.monotonic() - t0
                db = await sample(conn)
                started = read_count(worker_stats)
                w, e = wtail.read(), etail.read()
                enq = db["job_ids"] or 0  # every job inserted: the enqueuer's and the ticks
                try:
                    rss = wproc.memory_info().rss / 2**20
                    wcpu = sum(wproc.cpu_times()[:2]) - wcpu0
                except psutil.Error:
                    rss = wcpu = None
                cpu = server_cpu(postmaster)
                row = {
                    "t": round(now, 2),
                    "enqueued": enq,
                    "started": started,
                    "backlog": enq - started,
                    "enqueuer_behind_s": e.get("behind_s"),
                    "claims": w.get("claims"),
                    "claim_p50_ms": w.get("claim_p50_ms"),
                    "claim_p99_ms": w.get("claim_p99_ms"),
                    "claim_max_ms": w.get("claim_max_ms"),
                    "pickup_p50_ms": w.get("pickup_p50_ms"),
                    "pickup_p99_ms": w.get("pickup_p99_ms"),
                    "worker_rss_mb": rss,
                    "worker_cpu_s": wcpu,
                    "server_cpu_s": None if cpu is None or cpu0 is None else cpu - cpu0,
                    "load1": os.getloadavg()[0],
                    **db,
                }
                series.append(row)
                lines.write(json.dumps(row) + "\n")
                lines.flush()
                jobs = db["sizes"]
                print(
                    f"{now:6.0f}s enq {enq:>9,} done {started:>9,} backlog {enq - started:>8,}"
                    f" claim p50 {row['claim_p50_ms'] or 0:6.1f} p99 {row['claim_p99_ms'] or 0:7.1f}"
                    f" dead {db['tables']['jobs']['n_dead_tup']:>7,}"
                    f" claim_idx {jobs['jobs_claim_idx'] / 2**20:6.1f}MB"
                    f" table {jobs['jobs'] / 2**20:6.1f}MB vac {db['vacuuming_jobs']}"
                    f" av {db['tables']['jobs']['autovacuum_count']}/{db['tables']['jobs']['vacuum_count']}"
                    f" reltuples {db['jobs_reltuples']:.0f} load {row['load1']:.1f}",
                    flush=True,
                )
                if (
                    args.diagnose
                    and dumps < 3
                    and len(series) > 1
                    and started - series[-2]["started"] < 0.1 * rate * args.sample
                    and enq - started > rate
                ):  # a stall: what the worker and the server are doing
                    dumps += 1
                    spy = Path(sys.executable).with_name("py-spy")
                    got = subprocess.run(
                        [str(spy), "dump", "--pid", str(worker.pid)], capture_output=True, text=True
                    )
                    (out / f"stall-{dumps}.txt").write_text(
                        got.stdout
                        + got.stderr
                        + "\n"
                        + json.dumps(db["busy"], indent=1, default=str)
                    )
                if db["busy"] and db["busy"][0]["seconds"] > 0.5:
                    b = db["busy"][0]
                    print(f"        longest: {b['seconds']:.1f}s {b['wait_event']} {b['query']}")
                if enqueuer.poll() is not None:
                    if drained_at is None:
                        drained_at = now
                    if enq - started <= 0 or now - drained_at > args.drain:
                        break
                if worker.poll() is not None:
                    raise RuntimeError(f"the worker exited ({worker.returncode})")
    finally:
        if enqueuer is not None:
            stop(enqueuer)
        await conn.close()
        stop(worker)
    summary = {
        "capacity": cap,
        "rate": rate,
        "minutes": args.minutes,
        "mix": args.mix,
        "autovacuum": args.autovacuum,
        "aioq": args.aioq or "this checkout",
        **summarize(series, seconds, cap or rate),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.charts:
        import charts

        summary["charts"] = charts.soak_hour(summary, series, args.charts)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    return summary


# ---------------------------------------------------------------- verdicts

# A series is flat over the window when the drift its least-squares slope implies over the
# window is within noise: at most twice the slope's standard error (the series' own scatter),
# or at most FLAT_SHARE of its median (a drift too small to matter: an index that grew by a
# page, RSS by a few hundred kB). The fit is over one-minute means (a fortieth of a shorter
# window), so that samples that follow each other closely (a backlog, a vacuum) do not pass
# for independent evidence.
FLAT_SHARE = 0.05
WINDOW_SHARE = 2 / 3  # the last 40 minutes of an hour; the last two thirds of a shorter run


def fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(slope, its standard error) of a least-squares line through (x, y) points."""
    n = len(points)
    if n < 4:
        return None
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if not sxx:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in points)
    return slope, (residual / (n - 2) / sxx) ** 0.5


def means(points: list[tuple[float, float]], width: float) -> list[tuple[float, float]]:
    """The mean of each ``width`` seconds of points."""
    buckets: dict[int, list[float]] = {}
    for t, v in points:
        buckets.setdefault(int(t // width), []).append(v)
    return [(width * (k + 0.5), sum(v) / len(v)) for k, v in sorted(buckets.items())]


def flat(points: list[tuple[float, float]], window: float) -> dict[str, Any]:
    """The verdict on one series over ``window`` seconds (its points are inside it)."""
    # One-minute means over an hour's window; as many points (40) over a shorter one.
    averaged = means(points, window / 40)
    values = sorted(v for _, v in averaged)
    got = fit(averaged)
    if got is None or not values:
        return {"flat": None}
    slope, se = got
    median = values[len(values) // 2]
    drift = slope * window
    noise = 2 * se * window
    return {
        "flat": abs(drift) <= max(noise, FLAT_SHARE * abs(median)),
        "median": median,
        "drift": drift,  # over the window, in the series' unit
        "noise": noise,
        "first": averaged[0][1],
        "last": averaged[-1][1],
    }


def series_of(series: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Every charted series as (t, value): latencies, sizes, dead tuples, vacuum cadence,
    worker RSS, server CPU per job."""
    out: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, t: float, value: float | None) -> None:
        if value is not None:
            out.setdefault(name, []).append((t, float(value)))

    prev = None
    for row in series:
        t = row["t"]
        for key in ("claim_p50_ms", "claim_p99_ms", "pickup_p50_ms", "pickup_p99_ms"):
            add(key, t, row.get(key))
        add("backlog", t, row["backlog"])
        add("worker_rss_mb", t, row.get("worker_rss_mb"))
        for name, size in row["sizes"].items():
            add(f"size:{name}", t, size / 2**20)
        for name, table in row["tables"].items():
            if name in ("jobs", "results", "workflows", "workflow_steps", "workflow_deps"):
                add(f"dead:{name}", t, table["n_dead_tup"])
        if prev is not None:
            jobs = row["started"] - prev["started"]
            cpu, before = row.get("server_cpu_s"), prev.get("server_cpu_s")
            if jobs > 0 and cpu is not None and before is not None:
                add("server_cpu_ms_per_job", t, 1000 * (cpu - before) / jobs)
            jt, pt = row["tables"]["jobs"], prev["tables"]["jobs"]
            runs = jt["autovacuum_count"] + jt["vacuum_count"]
            runs -= pt["autovacuum_count"] + pt["vacuum_count"]
            add("jobs_vacuums_per_min", t, 60 * runs / (t - prev["t"]))
        prev = row
    return out


def summarize(series: list[dict[str, Any]], seconds: float, capacity: float) -> dict[str, Any]:
    """The run's figures and, per series, the verdict over the last two thirds of it."""
    steady = [r for r in series if r["t"] <= seconds]
    if not steady:
        return {}
    first, last = steady[0], steady[-1]
    window = WINDOW_SHARE * seconds
    verdicts = {
        name: flat([(t, v) for t, v in points if t >= seconds - window], window)
        for name, points in series_of(steady).items()
    }
    backlog_max = max(r["backlog"] for r in steady)
    stalls = [
        r["t"]
        for r, p in zip(steady[1:], steady, strict=False)
        if r["started"] == p["started"] and r["backlog"] > 0
    ]
    sizes = {
        name: {
            "first_mb": first["sizes"][name] / 2**20,
            "max_mb": max(r["sizes"][name] for r in steady) / 2**20,
            "last_mb": last["sizes"][name] / 2**20,
        }
        for name in last["sizes"]
        if name in first["sizes"]
    }
    return {
        "seconds": seconds,
        "window_s": window,
        "done_per_s": (last["started"] - first["started"]) / max(last["t"] - first["t"], 1e-9),
        "enqueued_per_s": (last["enqueued"] - first["enqueued"])
        / max(last["t"] - first["t"], 1e-9),
        "backlog_max": backlog_max,
        "backlog_max_s": backlog_max / capacity,
        "stalled_samples": len(stalls),
        "sizes": sizes,
        "load1_median": sorted(r["load1"] for r in steady)[len(steady) // 2],
        "verdicts": verdicts,
        "all_flat": all(v["flat"] is not False for v in verdicts.values()),
    }


def print_summary(summary: dict[str, Any]) -> None:
    print(
        f"done {summary.get('done_per_s', 0):,.0f}/s of {summary.get('enqueued_per_s', 0):,.0f}/s"
        f" deferred; backlog max {summary.get('backlog_max', 0):,} jobs"
        f" ({summary.get('backlog_max_s', 0):.1f} s of work); samples with no job started:"
        f" {summary.get('stalled_samples')}; load {summary.get('load1_median', 0):.1f}"
    )
    for name, v in summary.get("verdicts", {}).items():
        if v.get("flat") is None or (v["flat"] and name.startswith("size:") and v["median"] < 0.1):
            continue  # the small tables and indexes that stayed flat
        print(
            f"  {name:32} {'flat' if v['flat'] else 'NOT FLAT':8} median {v['median']:10.3f}"
            f" drift {v['drift']:+10.3f} (noise {v['noise']:.3f})"
        )


async def main_run(args: argparse.Namespace) -> None:
    if args.dsn:
        await soak(args, args.dsn, None)
        return
    sys.path.insert(0, str(HERE.parent))
    from aioq.dev.server import EmbeddedPostgres

    settings = {"autovacuum": args.autovacuum, "log_autovacuum_min_duration": "0"}
    settings.update(kv.split("=", 1) for kv in args.pg)
    with EmbeddedPostgres(settings=settings) as server:
        pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
        try:
            await soak(args, server.dsn, psutil.Process(pid))
        finally:
            log = server.data_dir.parent / "postgres.log"
            with contextlib.suppress(OSError):
                (Path(args.out) / "postgres.log").write_bytes(log.read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--dsn", help="a server to use (default: a throwaway stock one)")
    run.add_argument("--minutes", type=float, default=60.0)
    run.add_argument("--fraction", type=float, default=0.7)
    run.add_argument("--rate", type=float, help="jobs/s (default: --fraction of the capacity)")
    run.add_argument("--capacity", type=float, help="skip the capacity drain: this many jobs/s")
    run.add_argument("--autovacuum", choices=("on", "off"), default="on")
    run.add_argument("--mix", choices=("realistic", "noop"), default="realistic")
    run.add_argument("--sample", type=float, default=1.0, help="seconds between samples")
    run.add_argument("--drain", type=float, default=60.0, help="seconds to wait for the backlog")
    run.add_argument("--out", default=str(HERE / "soak-out"))
    run.add_argument("--aioq", default="", help="run the worker on the aioq package in this dir")
    run.add_argument("--pg", action="append", default=[], help="a server setting, name=value")
    run.add_argument("--charts", default="", help="write the charts into this directory")
    run.add_argument("--diagnose", action="store_true", help="py-spy dumps of a stalled worker")
    enq = sub.add_parser("enqueue")
    enq.add_argument("--dsn", required=True)
    enq.add_argument("--rate", type=float, required=True)
    enq.add_argument("--seconds", type=float, required=True)
    enq.add_argument("--mix", choices=("realistic", "noop"), default="realistic")
    enq.add_argument("--seed", type=int, default=1)
    enq.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "enqueue":
        asyncio.run(enqueue(args))
    else:
        global AIOQ_PATH
        AIOQ_PATH = args.aioq
        asyncio.run(main_run(args))


if __name__ == "__main__":
    main()
