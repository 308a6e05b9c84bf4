"""The issue's targets, each computed from the measured medians (never hard-coded)."""

from __future__ import annotations

import statistics
from typing import Any

Result = dict[str, Any]
PEERS = ("pgqueuer", "procrastinate", "chancy", "saq", "arq")


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


def targets(res: dict[str, list[Result]]) -> list[tuple[str, str, bool | None]]:
    out: list[tuple[str, str, bool | None]] = []
    drain = res.get("drain", [])
    a = _best(drain, ("aioq",), processes=1)
    peer = _best(drain, PEERS)
    if a and peer:
        x = a[0] / peer[0]
        out.append(
            (
                "drain ≥ 3x best peer at its best concurrency",
                f"aioq {a[0]:,.0f}/s ({a[1]}) vs {peer[1]} {peer[0]:,.0f}/s = {x:.2f}x",
                x >= 3,
            )
        )
    else:
        out.append(("drain ≥ 3x best peer at its best concurrency", "—", None))
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
    for scen, label, factor in (("defer_many", "defer_many ≥ 1.5x best peer", 1.5),):
        rows = res.get(scen, [])
        a1, p1 = _med(rows, system="aioq"), _best(rows, PEERS)
        ok = None if not (a1 and p1) else a1 / p1[0] >= factor
        out.append(
            (
                label,
                f"aioq {a1:,.0f}/s vs {p1[1]} {p1[0]:,.0f}/s = {a1 / p1[0]:.2f}x"
                if a1 and p1
                else "—",
                ok,
            )
        )
    rows = res.get("defer_one", [])
    a1, bare = _med(rows, system="aioq"), _med(rows, system="bare")
    out.append(
        (
            "defer_one ≥ 95 % of bare INSERT (no trigger)",
            f"aioq {a1:,.0f}/s vs bare {bare:,.0f}/s = {a1 / bare:.0%}" if a1 and bare else "—",
            None if not (a1 and bare) else a1 / bare >= 0.95,
        )
    )
    out += workload_targets(res)
    lat = res.get("latency", [])
    notify = [
        x
        for r in lat
        if r.get("system") == "aioq" and r.get("mode") in ("notify", "default")
        for x in r.get("samples_ms", [])
    ]
    poll = [
        (x, r["mode"])
        for r in lat
        if r.get("system") == "aioq" and str(r.get("mode")).startswith("poll")
        for x in r.get("samples_ms", [])
    ]
    for q, limit in ((0.5, 1.5), (0.99, 3.0)):
        name = f"latency p{int(q * 100)} ≤ {limit:g} ms with NOTIFY"
        if notify:
            v = _pct(notify, q)
            out.append((name, f"{v:.2f} ms ({len(notify)} samples)", v <= limit))
        else:
            out.append((name, "—", None))
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


def workload_targets(res: dict[str, list[Result]]) -> list[tuple[str, str, bool | None]]:
    """Issue 16's targets: defer_conc, io_bound, backlog."""
    out: list[tuple[str, str, bool | None]] = []
    rows = res.get("defer_conc", [])
    a, bare = _med(rows, system="aioq", concurrency=64), _med(rows, system="bare", concurrency=64)
    out.append(
        (
            "defer from 64 connections ≥ 90 % of bare INSERT",
            f"aioq {a:,.0f}/s vs bare {bare:,.0f}/s = {a / bare:.0%}" if a and bare else "—",
            None if not (a and bare) else a / bare >= 0.9,
        )
    )
    io = res.get("io_bound", [])
    a = _med(io, "of_ideal", system="aioq", concurrency=1000)
    out.append(
        (
            "I/O-bound c1000 in one process ≥ 90 % of ideal",
            f"{a:.0%} of 20 000 jobs/s" if a else "—",
            None if a is None else a >= 0.9,
        )
    )
    behind = []
    levels = sorted({r["concurrency"] for r in io if "concurrency" in r})
    for c in levels:
        ours = _med(io, system="aioq", concurrency=c)
        for peer in PEERS:
            theirs = _med(io, system=peer, concurrency=c)
            if ours and theirs and theirs >= ours:
                behind.append(f"{peer} c{c}")
    measured = bool(levels) and any(r.get("system") in PEERS for r in io)
    out.append(
        (
            "I/O-bound: ahead of every peer at every concurrency",
            ("behind " + ", ".join(behind))
            if behind
            else ("ahead everywhere" if measured else "—"),
            None if not measured else not behind,
        )
    )
    for r in res.get("backlog", [])[:1]:
        if "error" in r:
            continue
        for k in ("start", "end"):
            x = r[f"{k}_ms_p50"] / r["small_ms_p50"]
            out.append(
                (
                    f"backlog {r['jobs']:,}: claim p50 at the {k} ≤ 1.3x a 1 000-job backlog",
                    f"{r[f'{k}_ms_p50']:.3f} vs {r['small_ms_p50']:.3f} ms = {x:.2f}x",
                    x <= 1.3,
                )
            )
    return out
