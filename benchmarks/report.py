"""RESULTS.md and the charts, from results.json (``python report.py`` rewrites them)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections import defaultdict
from typing import Any

import plan
import systems
from targets import FLAT_MB, FLAT_SHARE, scale, targets

HERE = os.path.dirname(os.path.abspath(__file__))
PARAMS = (
    "system",
    "concurrency",
    "processes",
    "n",
    "mode",
    "rows",
    "tool",
    "clients",
    "batch",
    "payload_kb",
    "queues",
    "target_rate",
    "shape",
)

Result = dict[str, Any]
STATUS = {True: "met", False: "**missed**", None: "not measured"}


def brief(r: Result) -> str:
    """One line per measurement for the console."""
    if "error" in r:
        return "ERROR " + r["error"]
    if "samples_ms" in r:
        s = r["samples_ms"]
        return f"p50 {pct(s, 0.5):.2f} ms  p99 {pct(s, 0.99):.2f} ms  ({len(s)} samples)"
    if "start_ms_p50" in r:
        return f"claim p50 {r['small_ms_p50']:.3f} / {r['start_ms_p50']:.3f} / {r['end_ms_p50']:.3f} ms"
    if "rows_series" in r:
        return f"{r['enqueue_rate']:,.0f}/s in, p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms"
    if "of_ideal" in r:
        return f"{r['rate']:,.0f} jobs/s ({r['of_ideal']:.0%} of ideal), pickup p99 {r['pickup_ms_p99']:.1f} ms"
    if "claim_ms_p50" in r:
        return f"claim p50 {r['claim_ms_p50']:.3f} ms, drain {r['rate']:,.0f}/s"
    if "series" in r:
        return f"{r['enqueue_rate']:,.0f}/s in, p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms"
    if "us_per_step" in r:
        return f"fan-in after {r['seconds']:.2f} s ({r['us_per_step']:,.0f} µs/step)"
    if "installed" in r:
        return f"installed {r['installed']}"
    if "drain_per_s" in r:
        return f"defer_many {r['defer_per_s']:,.0f}/s, drain {r['drain_per_s']:,.0f} jobs/s"
    extra = " (capped)" if r.get("capped") else ""
    return f"{r['rate']:,.0f} jobs/s{extra}"


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def groups(rows: list[Result]) -> dict[tuple[Any, ...], list[Result]]:
    """Results of the same cell (all repeats), keyed by their parameters, in first-seen order."""
    out: dict[tuple[Any, ...], list[Result]] = defaultdict(list)
    for r in rows:
        out[tuple((k, r[k]) for k in PARAMS if k in r)].append(r)
    return out


def stat(rs: list[Result], field: str = "rate") -> tuple[float, float, float] | None:
    """(median, min, max) of a field over the repeats that have it."""
    vals = [r[field] for r in rs if r.get(field) is not None and "error" not in r]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def fmt(s: tuple[float, float, float] | None, digits: int = 0, unit: str = "") -> str:
    if s is None:
        return "—"
    med, lo, hi = s
    f = f"{{:,.{digits}f}}"
    return f"**{f.format(med)}**{unit} ({f.format(lo)}–{f.format(hi)})"


def errors(rs: list[Result]) -> str:
    errs = [r["error"] for r in rs if "error" in r]
    return f" ⚠ {len(errs)} failed: {errs[0]}" if errs else ""


PEERS = tuple(s for s in systems.ALL if s != "aioq")
PG_PEERS = tuple(s for s in systems.POSTGRES if s != "aioq")


def ratio_line(rows: list[Result], field: str = "rate", lower_is_better: bool = False) -> list[str]:
    """'aioq / best peer' over the per-cell medians (aioq's best cell vs the best peer cell)."""
    meds: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for key, rs in groups(rows).items():
        k = dict(key)
        s = stat(rs, field)
        if s is not None:
            label = k["system"] + (f" c{k['concurrency']}" if "concurrency" in k else "")
            if k.get("processes", 1) > 1:
                label = f"{k['system']} {k['processes']}xc{k['concurrency']}"
            meds[k["system"]].append((s[0], label))
    pick = min if lower_is_better else max
    ours = pick(meds["aioq"]) if meds.get("aioq") else None
    out = []
    for title, group in (("best peer", PEERS), ("best PostgreSQL peer", PG_PEERS)):
        peers = [m for p in group for m in meds.get(p, [])]
        if not ours or not peers:
            continue
        best = pick(peers)
        line = f"**aioq / {title}: {ours[0] / best[0]:.2f}x** ({ours[1]} {ours[0]:,.0f} vs {best[1]} {best[0]:,.0f})."
        if not out or line.split("(")[1] != out[-2].split("(")[1]:
            out += [line, ""]
    return out


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]


def enqueue_section(name: str, rows: list[Result], apis: dict[str, str]) -> list[str]:
    missing = [s for s, api in apis.items() if not api]
    g = groups(rows)
    bare = next((stat(rs) for k, rs in g.items() if dict(k)["system"] == "bare"), None)
    body = []
    for key, rs in g.items():
        system = dict(key)["system"]
        s = stat(rs)
        vs = f"{s[0] / bare[0]:.0%}" if s and bare else "—"
        cpu = stat(rs, "client_cpu_ms_per_1000")
        capped = " (capped)" if any(r.get("capped") for r in rs) else ""
        body.append(
            [system, f"`{apis.get(system, '')}`", fmt(s) + capped + errors(rs), vs, fmt(cpu)]
        )
    head = [
        "system",
        "call",
        "jobs/s median (min–max)",
        "vs bare INSERT",
        "client CPU ms / 1 000 jobs",
    ]
    out = table(head, body) + ratio_line(rows)
    if missing:
        out += [f"Not measured: {', '.join(missing)} (no bulk enqueue call in the library).", ""]
    return out


def drain_section(rows: list[Result]) -> list[str]:
    g = groups(rows)
    by_system: dict[str, dict[str, list[Result]]] = defaultdict(dict)
    for key, rs in g.items():
        k = dict(key)
        col = (
            f"c{k['concurrency']}"
            if k["processes"] == 1
            else f"{k['processes']}xc{k['concurrency']}"
        )
        by_system[k["system"]][col] = rs
    cols = sorted(
        {c for v in by_system.values() for c in v},
        key=lambda c: (c.count("x"), int(c.split("c")[-1])),
    )
    body = []
    for system, cells in by_system.items():
        body.append(
            [system, *(fmt(stat(cells[c])) + errors(cells[c]) if c in cells else "—" for c in cols)]
        )
    out = table(["system (jobs/s)", *cols], body) + ratio_line(rows)
    cpu = []
    for system, cells in by_system.items():
        for c in cols:
            if c in cells:
                w, p = stat(cells[c], "worker_cpu_per_1000"), stat(cells[c], "pg_cpu_per_1000")
                cpu.append([system, c, fmt(w, 3, " s"), fmt(p, 3, " s")])
    out += ["CPU seconds (user+sys) per 1 000 jobs during the drain:", ""]
    out += table(["system", "run", "worker process", "PostgreSQL backends"], cpu)
    sizes = {
        (k["system"], k["concurrency"] > 1): k["n"] for k in map(dict, g) if k["processes"] == 1
    }
    out += [
        "Jobs per drain (each sized to a few seconds of the system's rate, so that the c10 and "
        "c50 drains end before the time limit): "
        + ", ".join(
            f"{system} {sizes.get((system, False), 0):,} at c1, {sizes[(system, True)]:,} at c10/c50"
            for system in by_system
            if (system, True) in sizes
        )
        + ".",
        "",
    ]
    capped = [
        f"{dict(k)['system']} c{dict(k)['concurrency']}"
        for k, rs in g.items()
        if any(r.get("capped") for r in rs)
    ]
    if capped:
        out += [
            f"Capped in at least one repeat (the time limit ended the drain; rate = jobs done / time): {', '.join(capped)}.",
            "",
        ]
    return out


def latency_section(rows: list[Result]) -> list[str]:
    body = []
    for key, rs in groups(rows).items():
        k = dict(key)
        s = [x for r in rs for x in r.get("samples_ms", [])]
        per = stat([{"p50": pct(r["samples_ms"], 0.5)} for r in rs if r.get("samples_ms")], "p50")
        lost = sum(r.get("lost", 0) for r in rs)
        cells = [f"{pct(s, q):.2f}" for q in (0.5, 0.95, 0.99)] + [f"{max(s):.2f}" if s else "—"]
        body.append(
            [
                k["system"],
                k["mode"],
                *cells,
                fmt(per, 2),
                f"{len(s)}" + (f" ({lost} lost)" if lost else "") + errors(rs),
            ]
        )
    out = table(
        ["system", "wake-up", "p50 ms", "p95 ms", "p99 ms", "max ms", "p50 per repeat", "samples"],
        body,
    )
    return [
        *out,
        "Wake-up `default` is each library's own: LISTEN/NOTIFY for aioq, pgqueuer, procrastinate, "
        "chancy and oban (with their polling as the fallback, 1 s here where configurable; "
        "oban's NOTIFY comes from its insert statement); saq's blocking Redis pop; arq polls "
        "Redis (`poll_delay=0.05`, its default is 0.5 s); Celery's worker process blocks on a "
        "Redis pop and hands the task to a pool process (its task reports its start with a "
        "datagram stamped in that process).",
        "",
    ]


def history_section(rows: list[Result]) -> list[str]:
    body = []
    for key, rs in groups(rows).items():
        k = dict(key)
        idx = all(r.get("uses_claim_index") for r in rs if "error" not in r)
        body.append(
            [
                f"{k['rows']:,}",
                fmt(stat(rs, "claim_ms_p50"), 3),
                fmt(stat(rs, "claim_ms_p95"), 3),
                fmt(stat(rs, "complete_ms_p50"), 3),
                fmt(stat(rs)) + errors(rs),
                "yes" if idx else "NO",
            ]
        )
    return table(
        [
            "dead rows in aioq.jobs",
            "claim p50 ms",
            "claim p95 ms",
            "complete p50 ms",
            "drain c10 jobs/s",
            "claim plan uses jobs_claim_idx",
        ],
        body,
    )


def soak_section(rows: list[Result]) -> list[str]:
    out = []
    for r in rows:
        if "error" in r:
            out += [f"soak failed: {r['error']}", ""]
            continue
        share = (
            f"{r['target_rate'] / r['c50_rate']:.0%} of aioq's c50 drain median in this run;"
            " the enqueuer runs in the worker's process"
            if r.get("c50_rate")
            else "aioq's drain did not run: a fixed rate"
        )
        out += [
            f"### {r['target_rate']:,.0f} jobs/s",
            "",
            f"Target {r['target_rate']:,.0f} jobs/s ({share}), "
            f"achieved enqueue {r['enqueue_rate']:,.0f}/s; {r['done']:,} of {r['enqueued']:,} ran; "
            f"latency over the whole run p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms.",
            "",
            f"Server: {r.get('server', 'the main server')}; autovacuum settings "
            + ", ".join(f"{k} = {v}" for k, v in r.get("autovacuum", {}).items())
            + f". Task runs per enqueued job: {r.get('runs_per_job', 1):.4f}.",
            "",
        ]
        if r.get("rss_slope_mb_min") is not None:
            out += [
                f"Worker RSS (the process also runs the enqueuer): {r['rss_mb_first']:,.1f} MiB "
                f"after 1 s, {r['rss_mb_last']:,.1f} MiB at the end of the steady part, peak "
                f"{r['rss_mb_peak']:,.1f}; slope over the last {r['rss_second_half_s']:.0f} s "
                f"{r['rss_slope_mb_min']:+.2f} MiB/min.",
                "",
            ]
        if r.get("warnings"):
            out += ["aioq warnings during the soak:", ""]
            out += table(
                ["logger: message", "count"], [[f"`{k}`", str(v)] for k, v in r["warnings"].items()]
            )
        pick = [x for i, x in enumerate(r["series"]) if i % 10 == 9 or i == len(r["series"]) - 1]
        out += table(
            [
                "t s",
                "enqueued",
                "done",
                "backlog",
                "p50 ms",
                "p99 ms",
                "dead tuples",
                "live tuples",
                "table kB",
                "index kB",
                "autovacuums",
                "worker RSS MiB",
            ],
            [
                [
                    f"{x['t']:.0f}",
                    f"{x['enqueued']:,}",
                    f"{x['done']:,}",
                    f"{x['backlog']:,}",
                    f"{x['p50_ms']:.1f}" if x["p50_ms"] is not None else "—",
                    f"{x['p99_ms']:.1f}" if x["p99_ms"] is not None else "—",
                    f"{x['n_dead_tup']:,}",
                    f"{x['n_live_tup']:,}",
                    f"{x['table_bytes'] // 1024:,}",
                    f"{x['index_bytes'] // 1024:,}",
                    str(x["autovacuum_count"]),
                    f"{x['rss_mb']:,.1f}" if x.get("rss_mb") is not None else "—",
                ]
                for x in pick
            ],
        )
    return out


def ceiling_section(rows: list[Result]) -> list[str]:
    body = []
    for key, rs in groups(rows).items():
        k = dict(key)
        body.append([k["tool"], str(k["clients"]), str(k["batch"]), fmt(stat(rs)) + errors(rs)])
    return table(["tool", "clients", "claim batch", "jobs/s median (min–max)"], body)


def _by(rows: list[Result], param: str) -> dict[Any, dict[str, list[Result]]]:
    """Cells by a parameter value, then by system."""
    out: dict[Any, dict[str, list[Result]]] = defaultdict(dict)
    for key, rs in groups(rows).items():
        k = dict(key)
        out[k.get(param)][k["system"]] = rs
    return out


def defer_conc_section(rows: list[Result]) -> list[str]:
    body = []
    by = _by(rows, "concurrency")
    for c, cells in sorted(by.items()):
        bare = stat(cells.get("bare", []))
        aioq = stat(cells.get("aioq", []))
        for system, rs in cells.items():
            s = stat(rs)
            vs = f"{s[0] / bare[0]:.0%}" if s and bare else "—"
            ours = f"{aioq[0] / s[0]:.2f}x" if s and aioq and system not in ("aioq", "bare") else ""
            body.append([str(c), system, fmt(s) + errors(rs), vs, ours])
    return [
        *table(
            ["connections", "system", "jobs/s median (min–max)", "vs bare INSERT", "aioq / it"],
            body,
        ),
        "Each connection defers one job per transaction (autocommit) for the run's seconds; "
        "no worker runs, so aioq's doorbell has nobody to ring. procrastinate and chancy defer "
        "through their own pools (procrastinate's grows to 60 connections). The bare INSERT "
        "goes into a copy of aioq's jobs table without the trigger (`bare.jobs`).",
        "",
    ]


def io_bound_section(rows: list[Result]) -> list[str]:
    body = []
    for c, cells in sorted(_by(rows, "concurrency").items()):
        aioq = stat(cells.get("aioq", []))
        for system, rs in cells.items():
            s = stat(rs)
            ideal = rs[0].get("ideal") if rs else None
            capped = " (capped)" if any(r.get("capped") for r in rs) else ""
            body.append(
                [
                    str(c),
                    system,
                    fmt(s) + capped + errors(rs),
                    f"{s[0] / ideal:.0%}" if s and ideal else "—",
                    f"{aioq[0] / s[0]:.2f}x" if s and aioq and system != "aioq" else "",
                    fmt(stat(rs, "worker_cpu_per_1000"), 3, " s"),
                    fmt(stat(rs, "pickup_ms_p50"), 1),
                    fmt(stat(rs, "pickup_ms_p99"), 1),
                ]
            )
    head = [
        "concurrency",
        "system",
        "jobs/s",
        "of ideal",
        "aioq / it",
        "worker CPU / 1 000 jobs",
        "pickup p50 ms",
        "pickup p99 ms",
    ]
    return [
        *table(head, body),
        "Each task awaits `asyncio.sleep(0.05)`; ideal = concurrency / 0.05 s. Pickup: from a "
        "task's end (a slot frees) to the start of the next task, ends and starts matched in "
        "order, over the first 95 % of the drain (saturated).",
        "",
    ]


def payload_section(rows: list[Result]) -> list[str]:
    body = []
    for kb, cells in sorted(_by(rows, "payload_kb").items()):
        for system, rs in cells.items():
            body.append(
                [
                    f"{kb} KB",
                    system,
                    fmt(stat(rs, "defer_rate")) + errors(rs),
                    fmt(stat(rs, "defer_mb_s"), 1),
                    fmt(stat(rs, "defer_cpu_ms_per_job"), 3),
                    fmt(stat(rs)) + (" (capped)" if any(r.get("capped") for r in rs) else ""),
                    fmt(stat(rs, "worker_cpu_ms_per_job"), 3),
                ]
            )
    head = [
        "argument",
        "system",
        "bulk defer jobs/s",
        "MB/s",
        "client CPU ms / job",
        "drain c50 jobs/s",
        "worker CPU ms / job",
    ]
    return [
        *table(head, body),
        "The argument is a nested JSON object (order lines) of about the given size; the bulk API "
        "defers batches of 1 000 (1 KB) or 50 (64 KB). Capped: the defer or the drain reached "
        f"its {plan.PAYLOAD_LIMIT} s limit (a slow system defers and drains fewer jobs).",
        "",
    ]


def typed_section(rows: list[Result]) -> list[str]:
    shapes = _by(rows, "shape")
    plain = shapes.get("plain", {}).get("aioq", [])
    base = {f: _median(plain, f) for f in ("defer_per_s", "drain_per_s")}
    body = []
    for shape in plan.TYPED_SHAPES:
        rs = shapes.get(shape, {}).get("aioq", [])
        if not rs:
            continue
        defer, drain = stat(rs, "defer_per_s"), stat(rs, "drain_per_s")
        body.append(
            [
                shape,
                fmt(defer) + errors(rs),
                _ratio(_median(rs, "defer_per_s"), base["defer_per_s"]),
                fmt(stat(rs, "defer_cpu_ms_per_1000"), 1),
                fmt(drain),
                _ratio(_median(rs, "drain_per_s"), base["drain_per_s"]),
                fmt(stat(rs, "drain_cpu_ms_per_1000"), 1),
            ]
        )
    head = [
        "argument",
        "defer_many jobs/s",
        "of plain",
        "client CPU ms / 1 000",
        "drain c50 jobs/s",
        "of plain",
        "worker CPU ms / 1 000",
    ]
    return [
        *table(head, body),
        "Every shape stores the same JSON: an order of 10 fields (an int, a UUID, a datetime, a "
        "Decimal, an enum, a str, a float, a bool, a list of str, a date). plain passes it as a "
        "dict to a task annotated dict[str, Any]; dataclass and pydantic pass an instance, "
        "encoded at defer_many (batches of 1 000) and decoded into one before each run. The "
        "shapes run interleaved; the ratios are of medians. benchmarks/typed_values.py.",
        "",
    ]


def _median(rs: list[Result], field: str) -> float | None:
    found = stat(rs, field)
    return None if found is None else found[0]


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value and base else "—"


def backlog_section(rows: list[Result]) -> list[str]:
    out = []
    for r in rows:
        if "error" in r:
            out += [f"backlog failed: {r['error']}", ""]
            continue
        out += table(
            ["claim round trip", "p50 ms", "p99 ms", "p50 vs 1 000-job backlog"],
            [
                [
                    label,
                    f"{r[f'{k}_ms_p50']:.3f}",
                    f"{r[f'{k}_ms_p99']:.3f}",
                    f"{r[f'{k}_ms_p50'] / r['small_ms_p50']:.2f}x",
                ]
                for label, k in (
                    ("1 000 jobs pending", "small"),
                    (f"{r['jobs']:,} pending, at the start", "start"),
                    (
                        f"{r['jobs']:,} pending, ready part drained to "
                        f"{r.get('ready_at_end', 1000):,}",
                        "end",
                    ),
                )
            ],
        )
        out += [
            f"`defer_many` of the {r['jobs']:,} jobs ({r.get('ready', r['jobs'] // 2):,} ready, "
            f"the rest an hour ahead, batches of 10 000): {r['defer_many_s']:.1f} s "
            f"({r['defer_rate']:,.0f} jobs/s); `aioq stats` on it: {r['stats_s']:.2f} s (process "
            f"start included); the c50 drain of the ready part ran at {r['drain_rate']:,.0f} "
            "jobs/s.",
            "",
        ]
    return out


def queues_section(rows: list[Result]) -> list[str]:
    body = []
    for q, cells in sorted(_by(rows, "queues").items()):
        rs = cells.get("aioq", [])
        body.append(
            [
                str(q),
                fmt(stat(rs, "claim_ms_p50"), 3),
                fmt(stat(rs, "claim_ms_p99"), 3),
                fmt(stat(rs)) + errors(rs),
                fmt(stat(rs, "worker_cpu_per_1000"), 3, " s"),
            ]
        )
    return table(
        ["queues served", "claim p50 ms", "claim p99 ms", "drain c50 jobs/s", "worker CPU / 1 000"],
        body,
    )


def processes_section(rows: list[Result]) -> list[str]:
    body = []
    for p, cells in sorted(_by(rows, "processes").items()):
        rs = cells.get("aioq", [])
        share = stat(rs, "pg_cpu_share")
        body.append(
            [
                str(p),
                fmt(stat(rs)) + errors(rs),
                fmt(stat(rs, "worker_cpu_per_1000"), 3, " s"),
                fmt(stat(rs, "pg_cpu_per_1000"), 3, " s"),
                f"{share[0]:.0%}" if share else "—",
                fmt(stat(rs, "pg_cores_busy"), 2),
                fmt(stat(rs, "lock_waits_avg"), 2),
                fmt(stat(rs, "lwlock_waits_avg"), 2),
                fmt(stat(rs, "wal_bytes_per_job")),
            ]
        )
    head = [
        "processes ×c50",
        "jobs/s",
        "worker CPU / 1 000",
        "PostgreSQL CPU / 1 000",
        "PostgreSQL share of CPU",
        "PostgreSQL cores busy",
        "sessions waiting on locks (avg)",
        "on LWLocks (avg)",
        "WAL bytes / job",
    ]
    return table(head, body) + scale_model(rows)


def scale_model(rows: list[Result]) -> list[str]:
    """The scale model for N hosts: every figure and conclusion from this run's processes cells."""
    s = scale(rows)
    if s is None:
        return []
    pg_us, worker_us = s["pg_s_per_job"] * 1e6, s["worker_s_per_job"] * 1e6
    one = s["rates"][min(s["rates"])]
    lw = s["lwlocks"]
    lw_rising = lw[s["top"]] > 2 * lw[min(lw)] + 0.1
    out = [
        "### Scale model",
        "",
        "- Throughput with "
        + ", ".join(f"{p}" for p in s["rates"])
        + " processes × c50: "
        + " → ".join(f"{r:,.0f}" for r in s["rates"].values())
        + f" jobs/s ({s['speedup']:.2f}x at {s['top']}).",
        f"- PostgreSQL spends **{pg_us:.0f} µs of CPU per job** in the client backends (median of "
        "these runs; WAL writer, checkpointer and autovacuum come on top): **about "
        f"{s['per_pg_core']:,.0f} jobs/s per PostgreSQL core**. A worker spends {worker_us:.0f} µs "
        f"per job ({s['per_worker_core']:,.0f} jobs/s per worker core): one PostgreSQL core keeps "
        f"up with about {s['per_pg_core'] / one:.1f} worker processes at this run's one-process "
        f"rate ({one:,.0f} jobs/s).",
        f"- WAL: **{s['wal']:,.0f} bytes per job**: {s['wal'] * s['per_pg_core'] / 2**20:,.1f} "
        "MB/s of WAL per PostgreSQL core's worth of jobs, to write, fsync and replicate.",
    ]
    if s["host_bound"]:
        others = s["host_at_top"] - s["ours_at_top"]
        out.append(
            f"- What saturated first here: this host's CPU. At {s['top']} processes "
            f"{s['host_at_top']:.1f} of its {s['cores']} cores were busy ({s['ours_at_top']:.1f} "
            f"for the workers and their backends, PostgreSQL taking {s['pg_share_at_top']:.0%} of "
            "that"
            + (f"; {others:.1f} for other work on the machine" if others > 0.2 else "")
            + "): workers and database share the cores, so more processes on this host move "
            "CPU between them rather than add throughput."
        )
    else:
        out.append(
            f"- At {s['top']} processes {s['host_at_top']:.1f} of {s['cores'] or '?'} cores were "
            "busy: the CPU was not saturated, so round trips and waits set the rate here."
        )
    first = (
        "**PostgreSQL saturates first**: its CPU at about its cores × "
        f"{s['per_pg_core']:,.0f} jobs/s, or before that the LWLock contention that rose with "
        "the processes here (below)"
        if lw_rising
        else "**PostgreSQL's CPU saturates first**, at about its cores × "
        f"{s['per_pg_core']:,.0f} jobs/s"
    )
    out.append(
        "- With N hosts of W worker processes each (workers on their own cores), throughput "
        f"grows with N×W until PostgreSQL's cores are busy: {first}."
    )
    locks = (
        "near zero (SKIP LOCKED: workers do not wait on each other's rows)"
        if s["locks_at_top"] < 0.1
        else "not zero: workers wait on each other's locks"
    )
    out.append(
        f"- Sessions waiting on heavyweight locks at {s['top']} processes: "
        f"{s['locks_at_top']:.2f} on average, {locks}; on LWLocks: "
        + " → ".join(f"{v:.2f}" for v in lw.values())
        + (
            " — rising with processes: buffer and WAL-insertion contention"
            + (
                " (on this saturated host partly backends descheduled while holding one)."
                if s["host_bound"]
                else "."
            )
            if lw_rising
            else " (flat: no sign of buffer or WAL-insertion contention yet)."
        )
    )
    out += [
        "- What to do then: fewer statements per job (a bigger `claim_batch` and "
        "`completion_batch`); more cores for PostgreSQL and a database of its own for the queue; "
        "a WAL disk that keeps up with the MB/s above; beyond one primary, queues split over "
        "several databases, or a broker. The exit signals are in the README's Scale section.",
        "",
    ]
    return out


def mixed_section(rows: list[Result]) -> list[str]:
    out = []
    for r in rows:
        if "error" in r:
            out += [f"mixed failed: {r['error']}", ""]
            continue
        out += [
            f"A {r['backlog']:,}-job backlog drains (c50) while jobs are deferred at "
            f"{r['target_rate']:,.0f}/s (half the {r['drain_rate']:,.0f}/s at which the worker drained "
            "the backlog alone in the cell's first 3 s), achieved "
            f"{r['enqueue_rate']:,.0f}/s. Commit-to-start of the steady jobs: p50 "
            f"{r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms (they queue behind the backlog until "
            f"it is gone). Rows in aioq.jobs, one sample a second from the start of the steady "
            "deferring: "
            + ", ".join(f"{x:,}" for x in r["rows_series"])
            + f"; max {r['max_rows']:,} (backlog {r['backlog']:,}).",
            "",
        ]
    return out


def systems_section(meta: dict[str, Any]) -> list[str]:
    """How each system runs: what aioq's ``concurrency`` becomes in it, its calls, the rest."""
    apis = meta.get("apis", {})
    concurrency = apis.get("concurrency", {})
    if not concurrency:
        return []
    body = [
        [
            name,
            f"`{concurrency[name]}`",
            f"`{apis['single'].get(name, '')}`",
            f"`{apis['bulk'][name]}`" if apis["bulk"].get(name) else "none",
            apis.get("mapping", {}).get(name, ""),
        ]
        for name in concurrency
        if name != systems.REFERENCE
    ]
    return [
        *table(["system", "concurrency c (a per-worker cap)", "one job", "bulk", "the rest"], body),
        "Each system runs its own worker with its documented knob for the number of jobs one "
        "worker runs at once, set to the cell's concurrency; the rest is its defaults except "
        "where said. Versions are pinned in benchmarks/requirements*.txt.",
        "",
    ]


def memory_section(res: dict[str, list[Result]]) -> list[str]:
    """The worker's resident memory per system and scenario (peak, median over the repeats)."""
    columns = [
        ("drain", {"concurrency": 10, "processes": 1}, "drain c10"),
        ("drain", {"concurrency": 50, "processes": 1}, "drain c50"),
        ("io_bound", {"concurrency": 100}, "I/O-bound c100"),
        ("io_bound", {"concurrency": 1000}, "I/O-bound c1000"),
        ("backlog", {}, "backlog (c50)"),
        ("workflow", {}, "workflow (c50)"),
    ]
    cells: dict[str, dict[str, str]] = defaultdict(dict)
    kinds: dict[str, str] = {}
    for scenario, match, label in columns:
        for key, rs in groups(res.get(scenario, [])).items():
            k = dict(key)
            if any(k.get(f) != v for f, v in match.items()):
                continue
            peak, start = stat(rs, "mem_mb_peak"), stat(rs, "mem_mb_start")
            if peak is not None and start is not None:
                cells[k["system"]][label] = f"**{peak[0]:,.0f}** (start {start[0]:,.0f})"
                kinds[k["system"]] = rs[0].get("mem_kind", "rss")
    for r in res.get("soak", []):
        if r.get("rss_slope_mb_min") is not None:
            label = f"soak {r['target_rate']:,.0f}/s"
            cells["aioq"][label] = (
                f"{r['rss_mb_first']:,.0f} → {r['rss_mb_last']:,.0f} "
                f"({r['rss_slope_mb_min']:+.2f} MiB/min at the end)"
            )
            columns.append(("soak", {}, label))
    used = [label for _, _, label in columns if any(label in c for c in cells.values())]
    if not cells:
        return []
    body = [
        [f"{system}" + (" (PSS of its processes)" if kinds.get(system) == "pss" else ""),
         *(c.get(label, "—") for label in used)]
        for system, c in cells.items()
    ]  # fmt: skip
    out = table(["system: worker MiB, peak (at its start)", *used], body)
    out += [
        "Resident memory of the worker, sampled every 0.25 s (Celery's: every second) while it "
        "runs: peak, and the first "
        "sample (the worker just started, the backlog preloaded). An in-process worker shares "
        "the measuring process with the harness (its enqueue client and counters, the same for "
        "every system): its RSS. Celery's worker is a process with a pool of c children: the "
        "sum of their PSS (shared pages counted once). The soak's RSS over time is in its "
        "section.",
        "",
    ]
    return out


def workflow_section(rows: list[Result]) -> list[str]:
    body = []
    for key, rs in groups(rows).items():
        k = dict(key)
        body.append(
            [
                k["system"],
                f"{rs[0].get('steps', k.get('n', 0)):,}",
                fmt(stat(rs, "seconds"), 2, " s") + errors(rs),
                fmt(stat(rs, "us_per_step")),
                fmt(stat(rs, "submit_s"), 2, " s"),
                fmt(stat(rs, "cpu_us_per_step")),
                ", ".join(str(r.get("steps_before_fan_in", "—")) for r in rs),
            ]
        )
    return [
        *table(
            [
                "system",
                "steps",
                "time to the fan-in",
                "µs per step",
                "submit call",
                "CPU µs per step",
                "steps run before the fan-in",
            ],
            body,
        ),
        "One fan-out of n no-op steps and one fan-in that runs once every step has run, "
        "submitted to an idle worker at c50; the time runs from the submit call to the fan-in's "
        "start. CPU: the submitting process and the worker's (not the database's or Redis's). "
        "Celery: `chord(header)(body)` with its Redis result backend. aioq: an `aioq.Workflow` "
        "of n steps and a fan-in after them all, deferred in one transaction (one statement "
        "for the run, one per 4,000 steps), the fan-in made pending by the statement that "
        "records the last step's success.",
        "",
    ]


def write(data: dict[str, Any], out: str) -> None:
    import charts

    meta, res = data["meta"], data["results"]
    outdir = os.path.join(os.path.dirname(os.path.abspath(out)), "charts")
    os.makedirs(outdir, exist_ok=True)
    images = charts.draw(res, outdir)
    drawn = {f for v in images.values() for f in v.split(", ")}
    for stale in set(os.listdir(outdir)) - drawn:  # charts of scenarios this run did not draw
        if stale.endswith(".png"):
            os.remove(os.path.join(outdir, stale))
    apis = meta.get("apis", {})
    lines = [
        "# aioq benchmarks",
        "",
        f"Written by `{meta['command']}` on {meta['started']} in {meta['minutes']:.1f} min; "
        f"{meta['repeats']} repeat(s) per cell{' (--quick)' if meta['quick'] else ''}, each a fresh "
        "process on a fresh copy of the system's database, systems interleaved. Figures are "
        "medians with min–max over the repeats. Re-run with `make bench`.",
        "",
        f"- Machine: {meta['machine']}",
        *(
            [f"- Load average (1 min) at the start and the end: {meta['load']}"]
            if "load" in meta
            else []
        ),
        "- PostgreSQL: " + ", ".join(f"{k} {v}" for k, v in meta["server"].items()),
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        *(f"- {n}" for n in meta["notes"]),  # where the server and Redis came from
        *(
            [
                "- Scenarios merged from runs (`--merge`): "
                + "; ".join(f"{s} {t}" for s, t in meta["scenario_runs"].items())
            ]
            if meta.get("scenario_runs")
            else []
        ),
        *(f"- Skipped **{k}**: {v}" for k, v in meta["skipped"].items()),
        "",
        "## Targets",
        "",
    ]
    lines += table(
        ["target", "measured", "result"],
        [[t, m, STATUS.get(ok, str(ok))] for t, m, ok in targets(res)],
    )
    mapping = systems_section(meta)
    if mapping:
        lines += ["## How each system runs", "", *mapping]
    sections = [
        (
            "defer_one",
            "defer_one: one job per transaction",
            lambda r: enqueue_section("defer_one", r, apis.get("single", {})),
        ),
        (
            "defer_many",
            "defer_many: bulk API, 1 000 jobs per call",
            lambda r: enqueue_section("defer_many", r, apis.get("bulk", {})),
        ),
        (
            "defer_conc",
            "defer_conc: deferring from 1, 16 and 64 connections at once",
            defer_conc_section,
        ),
        ("drain", "drain: preloaded no-op jobs, the library's own worker", drain_section),
        ("io_bound", "io_bound: tasks that wait 50 ms, one worker process", io_bound_section),
        ("payload", "payload: 1 KB and 64 KB arguments", payload_section),
        (
            "latency",
            "latency: commit to task start, idle worker, one job every 20 ms",
            latency_section,
        ),
        ("history", "history: aioq with dead rows in the hot table", history_section),
        ("backlog", "backlog: a million pending jobs (aioq)", backlog_section),
        ("queues", "queues: one worker serving 50 queues against one (aioq)", queues_section),
        ("processes", "processes: `aioq worker --processes N` on one host", processes_section),
        ("mixed", "mixed: steady deferring while a backlog drains (aioq)", mixed_section),
        ("soak", "soak: steady enqueue near capacity (aioq)", soak_section),
        ("ceiling", "ceiling: aioq's claim/complete SQL with no worker", ceiling_section),
        ("workflow", "workflow: a fan-out with one fan-in", workflow_section),
        (
            "typed",
            "typed: dataclass and pydantic arguments against plain JSON (aioq)",
            typed_section,
        ),
    ]
    for name, title, fn in sections:
        if name in res:
            lines += [f"## {title}", "", *fn(res[name])]
            for image in images.get(name, "").split(", "):
                if image:
                    lines += [f"![{name}](charts/{image})", ""]
    mem = memory_section(res)
    if mem:
        lines += ["## memory: the worker's resident memory", "", *mem]
    lines += ["## Method", "", *method(meta["repeats"])]
    with open(out, "w") as f:
        f.write("\n".join(lines))


def method(repeats: int) -> list[str]:
    """How each scenario measures, with the full run's parameters from plan.py."""
    capped = ", ".join(f"{s} {n}" for s, n in plan.REPEATS.items() if n < repeats)
    peers = ", ".join(s for s in plan.IO_SYSTEMS if s != "aioq")
    return [
        "- Each measurement is `benchmarks/.venv/bin/python benchmarks/measure.py` (or `ceiling.py`) "
        "in its own process under a timeout; asyncio's default event loop for every system. "
        "Oban for Python needs Python >= 3.12 and Celery's Redis client conflicts with arq's: "
        "their cells run the same measure.py with the interpreter of a venv of their own "
        "(benchmarks/.venv-oban, .venv-celery, built by run.py from "
        "benchmarks/requirements-oban.txt and requirements-celery.txt; Oban is skipped, with the "
        "reason, where no Python >= 3.12 is found). "
        f"Repeats: {repeats} per cell"
        + (f", except (the time budget) {capped}" if capped else "")
        + "; once: c1 drain cells where a peer runs into the limit in every run on record, "
        "and procrastinate's c10 and c50 (20 to 60 times below every other system) ("
        + "; ".join(f"c{c} {', '.join(s)}" for c, s in plan.DRAIN_ONCE.items())
        + ")"
        + "; each round runs every cell once, systems interleaved, each round starting at "
        "another cell of the list.",
        "- Celery's worker is its own process (`celery worker --pool prefork --concurrency c`), "
        "started before the clock: it first consumes an empty queue, and the clock starts when "
        "it is told to consume the jobs' queue (`control.add_consumer`) once ready (the other "
        "systems' in-process workers start within the clock, in about 50 ms). Its tasks report "
        "their start and end with a datagram stamped with `time.perf_counter()` (one monotonic "
        "clock for the host's processes); its CPU is its process tree's (psutil).",
        "- defer_one: the library's normal single-enqueue call in autocommit, so one transaction "
        "per job; 50 warm-up calls first; at most "
        f"{plan.DEFER_ONE_LIMIT} s. The reference is a bare asyncpg `INSERT ... RETURNING id` of "
        "the same row into `bare.jobs`, a copy of aioq's jobs table (columns, defaults, indexes, "
        "storage settings) without the doorbell trigger.",
        "- defer_conc: k connections "
        + ", ".join(map(str, plan.DEFER_CONC))
        + f" each deferring one job per transaction in a loop for {plan.DEFER_CONC_SECONDS:g} s, "
        "after 5 warm-up calls each; jobs/s = all jobs / elapsed. No worker runs.",
        f"- io_bound: a backlog of concurrency / 0.05 × {plan.IO_WORK:g} s jobs, preloaded through "
        "the bulk API; each task awaits `asyncio.sleep(0.05)`; the clock runs from the worker's "
        f"start to the last task's end, at most {plan.IO_LIMIT} s (capped). Peers: {peers} "
        "(procrastinate drains about 100 no-op jobs/s at any concurrency, far below every ideal "
        "here; chancy and arq left out for the time budget; Celery's docs recommend another pool, "
        "gevent or eventlet, for I/O-bound tasks than the prefork one measured here).",
        "- payload: N jobs with an extra `blob` argument (nested JSON of the given size) deferred "
        "through the bulk API (timed: defer jobs/s, MB/s and client CPU), then drained at c50; "
        f"each phase stops at {plan.PAYLOAD_LIMIT} s (capped: a slow peer defers fewer jobs).",
        "- backlog: aioq only. 300 single-job claims (each completed) with 1 000 jobs pending; then "
        f"{plan.BACKLOG_JOBS:,} jobs deferred (batches of 10 000: a quarter ready, the rest with "
        "`delay=3600`), `aioq stats` run on it, 300 claims, a c50 worker drains the ready quarter "
        f"down to 1 300 (at most {plan.BACKLOG_LIMIT} s), 300 claims again. The peers get no "
        "million-job backlog: their bulk calls would take 20 s to several minutes to defer it.",
        "- queues: aioq only; the same claims with the jobs spread over 50 queues and one worker "
        "serving all 50, against one queue; then a c50 drain.",
        "- processes: aioq's CLI `--processes N --concurrency 50`, jobs committed once every "
        "process listens; every 10 ms pg_stat_activity is sampled for sessions of the database "
        "waiting on a heavyweight lock or an LWLock (averages shown); WAL = pg_current_wal_lsn() "
        "difference over the drain / jobs; the host's busy CPU from psutil.cpu_times().",
        "- mixed: aioq only; a 100 000-job backlog drains at c50, alone for 3 s (its rate "
        "measured), then while `defer_many` every 20 ms adds jobs at half that rate, for "
        f"{plan.MIXED_SECONDS} s; the row count of aioq.jobs sampled every second.",
        "- drain: jobs preloaded through the bulk API (not timed); the clock starts as the worker "
        "starts and stops when the in-process task counter reached N and the database shows no "
        "job left (pending or running), or at the limit (capped: rate = jobs done / time): "
        f"{plan.DRAIN_C1_LIMIT} s at c1, where the peers' rates decide no ratio; at c10 and c50 "
        "N is sized per system to a few seconds of its rate ("
        + ", ".join(f"{s} {n:,}" for s, n in plan.DRAIN_JOBS.items())
        + f") under a {plan.DRAIN_LIMIT} s guard, so no drain that decides a ratio is cut. "
        "aioq `2xc50` is the CLI, `aioq worker --processes 2 --concurrency 50`, measured as in "
        "processes.",
        "- CPU: the worker's user+sys from `getrusage(RUSAGE_SELF)` (psutil over the process tree "
        "for the CLI and Celery); PostgreSQL's from psutil (`/proc/<pid>/stat`) of the client "
        "backends connected to the measured database (from `pg_stat_activity`), start-to-stop "
        "deltas, not counting WAL writer, checkpointer or autovacuum.",
        "- memory: psutil every 0.25 s (Celery: 1 s) while the worker runs (drain, io_bound, "
        "backlog, workflow): "
        "the RSS of the measuring process for in-process workers, the summed PSS of Celery's "
        "worker processes; each second of the soak.",
        "- latency: `time.perf_counter()` in one process: after the enqueue call returned "
        "(committed) and at the first line of the task; the worker is idle and in the same "
        "process (Celery: its own, see above). aioq's poll-only run sets "
        f"`WorkerConfig.listen=False` with `poll_interval={plan.LATENCY_POLL:g}`.",
        "- history: 1e3 or 1e6 dead jobs inserted into aioq.jobs (the hot table, the worst place "
        "for history), VACUUM ANALYZE; 500 claims of one job + completes timed one by one, then a "
        "c10 drain.",
        "- soak: aioq's worker at c50 in the same process as an enqueuer calling `defer_many` every "
        "20 ms, at "
        + " and ".join(f"{f:.0%}" for f in plan.SOAK_FRACTIONS)
        + f" of aioq's c50 drain rate, for {plan.SOAK_SECONDS} s, then until the backlog is done. "
        "Per second: p50/p99 of commit-to-start latency of the jobs started in that second "
        "(perf_counter), backlog (count), n_dead_tup/n_live_tup/autovacuum_count from "
        "pg_stat_user_tables, pg_table_size and pg_indexes_size of aioq.jobs, the process's RSS. "
        "Flat: the least-squares slope of RSS over the second half of the steady part implies "
        f"a change over that half of at most {FLAT_MB:g} MiB or {FLAT_SHARE:.0%} of the RSS.",
        "- ceiling: `ceiling.py` runs aioq's own CLAIM_ONE_QUEUE and COMPLETE statements (rendered "
        "from aioq/sql/jobs.py) from k asyncpg connections with 50-job claims; pgbench runs the same "
        "claim then deletes the client's running rows (pgbench cannot pass arrays of claimed ids).",
        f"- workflow: {plan.WORKFLOW_STEPS:,} no-op steps and one fan-in, the worker at c50, at most "
        f"{plan.WORKFLOW_LIMIT} s.",
        "- The machine may be shared; the load average at the run's start and end is in the "
        "header. Compare ratios within a run (the systems ran interleaved), not absolute rates "
        "across runs.",
    ]


if __name__ == "__main__":
    path = os.path.join(HERE, "results.json")
    with open(path) as f:
        write(json.load(f), sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "RESULTS.md"))
