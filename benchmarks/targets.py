"""The issues' targets, each computed from the run's medians (never hard-coded).

A target row is (target, measured, status): status True (met), False (missed), None (not
measured in this run) or a word shown as it is ("reported": a figure the issue asks for, with
no threshold).
"""

from __future__ import annotations

import statistics
from typing import Any

import systems

Result = dict[str, Any]
Row = tuple[str, str, bool | str | None]
PEERS = tuple(s for s in systems.ALL if s != "aioq")
REPORTED = "reported"
LATENCY_SAMPLES = 400  # fewer, and a p99 is the second-worst few samples
# Memory flat over the soak: the growth its second half's slope implies over that half is at
# most this many MiB, or this share of the RSS, whichever is larger.
FLAT_MB, FLAT_SHARE = 1.0, 0.02


def _med(results: list[Result], field: str = "rate", **match: Any) -> float | None:
    vals = [
        r[field]
        for r in results
        if "error" not in r
        and r.get(field) is not None
        and all(r.get(k) == v for k, v in match.items())
    ]
    return statistics.median(vals) if vals else None


def _best(
    rows: list[Result],
    systems: tuple[str, ...],
    field: str = "rate",
    low: bool = False,
    **match: Any,
) -> tuple[float, str] | None:
    """The best per-cell median among these systems (highest, or lowest with low=True)."""
    cells: dict[tuple[Any, ...], list[Result]] = {}
    for r in rows:
        if r.get("system") in systems and all(r.get(k) == v for k, v in match.items()):
            key = (r["system"], r.get("concurrency"), r.get("processes"))
            cells.setdefault(key, []).append(r)
    found = [
        (m, f"{k[0]}" + (f" c{k[1]}" if k[1] else ""))
        for k, rs in cells.items()
        if (m := _med(rs, field)) is not None
    ]
    if not found:
        return None
    return min(found) if low else max(found)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ratio_row(
    name: str, ours: float | None, theirs: float | None, what: str, at_least: float, times: bool
) -> Row:
    """'aioq X/s vs <what> Y/s = Z' (a percentage, or a factor with ``times``), met at_least."""
    if not (ours and theirs):
        return (name, "—", None)
    x = ours / theirs
    shown = f"{x:.2f}x" if times else f"{x:.0%}"
    return (name, f"aioq {ours:,.0f}/s vs {what} {theirs:,.0f}/s = {shown}", x >= at_least)


def targets(res: dict[str, list[Result]]) -> list[Row]:
    """Issue 16's targets first, then the earlier issues', then memory and the workflow."""
    return (
        issue16(res)
        + earlier(res)
        + memory(res)
        + workflow(res.get("workflow", []))
        + typed(res.get("typed", []))
    )


def issue16(res: dict[str, list[Result]]) -> list[Row]:
    return [
        *io_bound(res.get("io_bound", [])),
        *payload(res.get("payload", [])),
        *backlog(res.get("backlog", [])),
        *queues(res.get("queues", [])),
        *processes(res.get("processes", [])),
        *mixed(res.get("mixed", [])),
        *doorbell(res.get("defer_conc", []), res.get("latency", [])),
        *noop_gap(res.get("drain", []), res.get("ceiling", []), res.get("defer_one", [])),
    ]


def io_bound(io: list[Result]) -> list[Row]:
    a = _med(io, "of_ideal", system="aioq", concurrency=1000)
    out: list[Row] = [
        (
            "I/O-bound c1000 in one process ≥ 90 % of ideal",
            f"{a:.0%} of 20 000 jobs/s" if a else "—",
            None if a is None else a >= 0.9,
        )
    ]
    levels = sorted({r["concurrency"] for r in io if "concurrency" in r})
    ratios, behind = [], False
    for c in levels:
        ours = _med(io, system="aioq", concurrency=c)
        peer = _best(io, PEERS, concurrency=c)
        if ours and peer:
            ratios.append(f"c{c} {ours / peer[0]:.2f}x {peer[1].split()[0]}")
            behind = behind or ours <= peer[0]
    out.append(
        (
            "I/O-bound: ahead of every peer at every concurrency (aioq / best peer)",
            ", ".join(ratios) if ratios else "—",
            None if not ratios else not behind,
        )
    )
    return out


def payload(rows: list[Result]) -> list[Row]:
    out: list[Row] = []
    for kb in sorted({r["payload_kb"] for r in rows if "payload_kb" in r}):
        for field, what in (("defer_rate", "bulk defer"), ("rate", "drain c50")):
            ours = _med(rows, field, system="aioq", payload_kb=kb)
            peer = _best(rows, PEERS, field, payload_kb=kb)
            out.append(
                _ratio_row(
                    f"payload {kb} KB: aioq leads {what}",
                    ours,
                    peer[0] if peer else None,
                    peer[1] if peer else "",
                    1.0,
                    times=True,
                )
            )
    return out or [("payload 1 KB and 64 KB: aioq leads bulk defer and drain", "—", None)]


def backlog(rows: list[Result]) -> list[Row]:
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return [("backlog 1,000,000: claim p50 ≤ 1.3x a 1 000-job backlog", "—", None)]
    r = ok[0]
    out: list[Row] = []
    for k in ("start", "end"):
        x = r[f"{k}_ms_p50"] / r["small_ms_p50"]
        left = (
            f" ({r['ready_at_end']:,} ready left: the drain hit its limit)"
            if k == "end" and r.get("ready_at_end", 0) > 1000
            else ""
        )
        out.append(
            (
                f"backlog {r['jobs']:,}: claim p50 at the {k} ≤ 1.3x a 1 000-job backlog",
                f"{r[f'{k}_ms_p50']:.3f} vs {r['small_ms_p50']:.3f} ms = {x:.2f}x{left}",
                x <= 1.3,
            )
        )
    return out


def queues(rows: list[Result]) -> list[Row]:
    most = max((r["queues"] for r in rows if "queues" in r), default=50)
    one, many = _med(rows, "claim_ms_p50", queues=1), _med(rows, "claim_ms_p50", queues=most)
    name = f"many queues: claim p50 serving {most} queues against one (no threshold in the issue)"
    if not (one and many) or most == 1:
        return [(name, "—", None)]
    return [(name, f"{many:.3f} vs {one:.3f} ms = {many / one:.2f}x", REPORTED)]


def scale(rows: list[Result]) -> dict[str, Any] | None:
    """What the processes runs say about scaling out (the scale model's numbers)."""
    ok = [r for r in rows if "error" not in r and r.get("pg_cpu_per_1000")]
    if not ok:
        return None
    by_p: dict[int, list[Result]] = {}
    for r in ok:
        by_p.setdefault(r["processes"], []).append(r)
    top = max(by_p)
    at_top = by_p[top]

    def med(rs: list[Result], field: str) -> float:
        return statistics.median(r[field] for r in rs if r.get(field) is not None)

    pg = med(ok, "pg_cpu_per_1000") / 1000  # seconds of PostgreSQL CPU per job
    worker = med(ok, "worker_cpu_per_1000") / 1000
    cores = at_top[0].get("cores") or 0
    ours = med(at_top, "pg_cores_busy") + (
        med(at_top, "worker_cores_busy") if any("worker_cores_busy" in r for r in at_top) else 0.0
    )
    host = med(at_top, "host_cores_busy") if any("host_cores_busy" in r for r in at_top) else ours
    return {
        "rates": {p: med(rs, "rate") for p, rs in sorted(by_p.items())},
        "top": top,
        "speedup": med(at_top, "rate") / med(by_p[min(by_p)], "rate"),
        "pg_s_per_job": pg,
        "worker_s_per_job": worker,
        "per_pg_core": 1 / pg,
        "per_worker_core": 1 / worker,
        "wal": med(ok, "wal_bytes_per_job"),
        "cores": cores,
        "ours_at_top": ours,
        "host_at_top": host,
        "host_bound": bool(cores) and host >= 0.85 * cores,
        "pg_share_at_top": med(at_top, "pg_cpu_share"),
        "locks_at_top": med(at_top, "lock_waits_avg"),
        "lwlocks": {p: med(rs, "lwlock_waits_avg") for p, rs in sorted(by_p.items())},
    }


def processes(rows: list[Result]) -> list[Row]:
    s = scale(rows)
    name = "processes 1/2/4: throughput and the scale model (RESULTS.md, processes)"
    if s is None:
        return [(name, "—", None)]
    rates = " → ".join(f"{r:,.0f}" for r in s["rates"].values())
    limit = (
        f"this host's CPU ({s['host_at_top']:.1f} of {s['cores']} cores busy)"
        if s["host_bound"]
        else f"not the CPU ({s['host_at_top']:.1f} of {s['cores'] or '?'} cores busy)"
    )
    return [
        (
            name,
            f"{rates} jobs/s ({s['speedup']:.2f}x at {s['top']}); about "
            f"{s['per_pg_core']:,.0f} jobs/s per PostgreSQL core; first limit here: {limit}",
            REPORTED,
        )
    ]


def mixed(rows: list[Result]) -> list[Row]:
    ok = [r for r in rows if "error" not in r and r.get("rows_series")]
    if not ok:
        return [
            ("mixed: pickup p99 of the steadily deferred jobs", "—", None),
            ("mixed: no growth of the table beyond the backlog", "—", None),
        ]
    r = ok[0]
    return [
        (
            "mixed: pickup p99 of the steadily deferred jobs (no threshold in the issue)",
            f"p50 {r['p50_ms']:,.1f} ms, p99 {r['p99_ms']:,.1f} ms at {r['enqueue_rate']:,.0f}/s"
            f" in while {r['backlog']:,} drain",
            REPORTED,
        ),
        (
            "mixed: no growth of the table beyond the backlog",
            f"max {r['max_rows']:,} rows (sampled each second) vs backlog {r['backlog']:,};"
            f" last {r['rows_series'][-1]:,}",
            r["max_rows"] <= r["backlog"],
        ),
    ]


def doorbell(conc: list[Result], lat: list[Result]) -> list[Row]:
    out = [
        _ratio_row(
            "defer from 64 connections ≥ 90 % of bare INSERT",
            _med(conc, system="aioq", concurrency=64),
            _med(conc, system="bare", concurrency=64),
            "bare",
            0.9,
            times=False,
        )
    ]
    notify = [
        x
        for r in lat
        if r.get("system") == "aioq" and r.get("mode") in ("notify", "default")
        for x in r.get("samples_ms", [])
    ]
    for q, limit in ((0.5, 1.0), (0.99, 2.0)):
        name = f"… while idle pickup p{int(q * 100)} ≤ {limit:g} ms (latency, NOTIFY)"
        if not notify:
            out.append((name, "—", None))
        elif q > 0.5 and len(notify) < LATENCY_SAMPLES:
            out.append((name, f"{len(notify)} samples: fewer than {LATENCY_SAMPLES}", None))
        else:
            v = _pct(notify, q)
            out.append((name, f"{v:.2f} ms ({len(notify)} samples)", v <= limit))
    return out


def noop_gap(drain: list[Result], ceiling: list[Result], one: list[Result]) -> list[Row]:
    c50 = _med(drain, system="aioq", concurrency=50, processes=1)
    c10 = _med(drain, system="aioq", concurrency=10, processes=1)
    best = _best(drain, ("aioq",), processes=1)
    loop = _med(ceiling, tool="asyncpg loop", clients=1)
    return [
        _ratio_row(
            "no-op drain in one process at its best concurrency"
            + (f" ({best[1].split()[-1]})" if best else "")
            + " ≥ 85 % of the raw-SQL loop (one connection, 50 jobs per claim, batched deletes)",
            best[0] if best else None,
            loop,
            "the loop",
            0.85,
            times=False,
        ),
        _ratio_row(
            "no-op drain c10 within 20 % of c50 (c10 ≥ 0.8 × c50)",
            c10,
            c50,
            "c50",
            0.8,
            times=False,
        ),
        _ratio_row(
            "defer_one ≥ 95 % of bare INSERT (no trigger)",
            _med(one, system="aioq"),
            _med(one, system="bare"),
            "bare",
            0.95,
            times=False,
        ),
    ]


def earlier(res: dict[str, list[Result]]) -> list[Row]:
    """The targets of the issues before 16, still checked."""
    out: list[Row] = []
    drain = res.get("drain", [])
    a = _best(drain, ("aioq",), processes=1)
    peer = _best(drain, PEERS)
    if a and peer:
        x = a[0] / peer[0]
        capped = any(
            r.get("capped")
            for r in drain
            if r.get("system") == peer[1].split()[0]
            and f"c{r.get('concurrency')}" == peer[1].split()[-1]
        )
        out.append(
            (
                "drain ≥ 5x best peer at its best concurrency (one process each)",
                f"aioq {a[0]:,.0f}/s ({a[1]}) vs {peer[1]} {peer[0]:,.0f}/s = {x:.2f}x"
                + (
                    " (that drain hit the time limit: the ratio may overstate the lead)"
                    if capped
                    else ""
                ),
                x >= 5,
            )
        )
    else:
        out.append(("drain ≥ 5x best peer at its best concurrency (one process each)", "—", None))
    a_all = _best(drain, ("aioq",))
    ceil = _best(res.get("ceiling", []), ("ceiling",), tool="asyncpg loop")
    if a_all and ceil:
        x = a_all[0] / ceil[0]
        out.append(
            (
                "drain ≥ 50 % of the batch-claim ceiling (asyncpg loop)",
                f"aioq {a_all[0]:,.0f}/s ({a_all[1]}, any run) vs ceiling {ceil[0]:,.0f}/s = {x:.0%}",
                x >= 0.5,
            )
        )
    else:
        out.append(("drain ≥ 50 % of the batch-claim ceiling (asyncpg loop)", "—", None))
    rows = res.get("defer_many", [])
    p1 = _best(rows, PEERS)
    out.append(
        _ratio_row(
            "defer_many ≥ 1.5x best peer",
            _med(rows, system="aioq"),
            p1[0] if p1 else None,
            p1[1] if p1 else "",
            1.5,
            times=True,
        )
    )
    poll = [
        (x, r["mode"])
        for r in res.get("latency", [])
        if r.get("system") == "aioq" and str(r.get("mode")).startswith("poll")
        for x in r.get("samples_ms", [])
    ]
    if poll:
        interval = float(poll[0][1].split()[1].rstrip("s")) * 1000
        v = _pct([x for x, _ in poll], 0.5)
        out.append(
            (
                "poll-only p50 ≤ half the poll interval",
                f"{v:.1f} ms vs {interval / 2:.0f} ms (poll interval {interval:.0f} ms)",
                v <= interval / 2,
            )
        )
    else:
        out.append(("poll-only p50 ≤ half the poll interval", "—", None))
    hist = res.get("history", [])
    rows_seen = sorted({r["rows"] for r in hist if "rows" in r})
    if len(rows_seen) >= 2:
        lo, hi = rows_seen[0], rows_seen[-1]
        for field, label, inverse in (
            ("claim_ms_p50", "claim round trip", False),
            ("rate", "drain rate", True),
        ):
            a_lo, a_hi = _med(hist, field, rows=lo), _med(hist, field, rows=hi)
            if a_lo and a_hi:
                x = a_lo / a_hi if inverse else a_hi / a_lo
                out.append(
                    (
                        f"history {hi:,} rows ≤ 1.3x {lo:,} rows: {label}",
                        f"{a_hi:,.3f} vs {a_lo:,.3f}: cost ratio {x:.2f}x",
                        x <= 1.3,
                    )
                )
    else:
        out.append(("history 1e6 ≤ 1.3x 1e3", "—", None))
    a = _best(drain, ("aioq",), "worker_cpu_per_1000", low=True, processes=1)
    peer = _best(drain, PEERS, "worker_cpu_per_1000", low=True)
    if a and peer:
        x = peer[0] / a[0]
        out.append(
            (
                "worker CPU per 1 000 jobs ≥ 2x lower than best peer",
                f"aioq {a[0]:.3f} s ({a[1]}) vs {peer[1]} {peer[0]:.3f} s = {x:.2f}x lower",
                x >= 2,
            )
        )
    else:
        out.append(("worker CPU per 1 000 jobs ≥ 2x lower than best peer", "—", None))
    return out


def _mem(rows: list[Result], **match: Any) -> float | None:
    return _med(rows, "mem_mb_peak", **match)


def memory(res: dict[str, list[Result]]) -> list[Row]:
    """The worker's resident memory: at c1000, with a 1e6 backlog, over the soak (flat?)."""
    out: list[Row] = []
    io = res.get("io_bound", [])
    ours = _mem(io, system="aioq", concurrency=1000)
    peers = [(p, m) for p in PEERS if (m := _mem(io, system=p, concurrency=1000)) is not None]
    out.append(
        (
            "memory: worker peak RSS at concurrency 1 000 (I/O-bound), against the peers",
            (
                f"aioq {ours:,.0f} MiB"
                + "".join(f", {p} {m:,.0f}" for p, m in peers)
                + " (the harness's process: see memory)"
            )
            if ours is not None
            else "—",
            REPORTED if ours is not None else None,
        )
    )
    back = [r for r in res.get("backlog", []) if "mem_mb_peak" in r]
    jobs = back[0]["jobs"] if back else 1_000_000
    out.append(
        (
            f"memory: worker peak RSS draining a {jobs:,}-job backlog (c50)",
            f"aioq {back[0]['mem_mb_peak']:,.0f} MiB (at its start {back[0]['mem_mb_start']:,.0f})"
            if back
            else "—",
            REPORTED if back else None,
        )
    )
    soaks = [r for r in res.get("soak", []) if r.get("rss_slope_mb_min") is not None]
    name = "memory: flat over the soak (RSS slope over its second half)"
    if not soaks:
        out.append((name, "—", None))
    for r in soaks:
        half = r["rss_second_half_s"] or 0.0
        growth = r["rss_slope_mb_min"] * half / 60
        allowed = max(FLAT_MB, FLAT_SHARE * r["rss_mb_last"])
        out.append(
            (
                f"{name}, {r['target_rate']:,.0f} jobs/s",
                f"{r['rss_slope_mb_min']:+.2f} MiB/min over the last {half:.0f} s "
                f"({growth:+.2f} MiB; allowed ±{allowed:.1f}); RSS {r['rss_mb_first']:,.1f} → "
                f"{r['rss_mb_last']:,.1f} MiB",
                abs(growth) <= allowed,
            )
        )
    return out


def workflow(rows: list[Result]) -> list[Row]:
    """A 10 000-step fan-out with one fan-in: aioq's time to the fan-in against each peer's."""
    name = "workflow: fan-out with one fan-in, time to the fan-in (no threshold in the issue)"
    ok = [r for r in rows if "error" not in r and "seconds" in r]
    if not ok:
        return [(name, "—", None)]
    by = {s: m for s in {r["system"] for r in ok} if (m := _med(ok, "seconds", system=s))}
    n = ok[0]["steps"]
    shown = ", ".join(f"{s} {m:,.1f} s ({1e6 * m / n:,.0f} µs/step)" for s, m in by.items())
    if "aioq" not in by:
        shown += "; aioq: no workflow yet"
    return [(f"{name}, {n:,} steps", shown, REPORTED if "aioq" in by else None)]


def typed(rows: list[Result]) -> list[Row]:
    """Typed arguments: a 10-field dataclass and a pydantic model against the same JSON as a
    dict, defer_many and the c50 drain each at least 90 % of plain's rate (medians)."""
    out: list[Row] = []
    for field, what in (("drain_per_s", "drain c50"), ("defer_per_s", "defer_many")):
        plain = _med(rows, field, shape="plain")
        for shape in ("dataclass", "pydantic"):
            ours = _med(rows, field, shape=shape)
            name = f"typed {what}: a 10-field {shape} argument ≥ 90 % of plain JSON's rate"
            if not (ours and plain):
                out.append((name, "—", None))
                continue
            shown = f"{ours:,.0f}/s vs {plain:,.0f}/s = {ours / plain:.0%}"
            out.append((name, shown, ours / plain >= 0.9))
    return out
