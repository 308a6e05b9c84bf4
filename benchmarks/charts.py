"""PNG charts with matplotlib (Agg): drain throughput vs concurrency, latency CDF, soak."""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Result = dict[str, Any]


def draw(res: dict[str, list[Result]], outdir: str) -> dict[str, str]:
    """Draw what the results allow; return {scenario: file name}."""
    out = {}
    if res.get("drain"):
        out["drain"] = _drain(res["drain"], outdir)
    if res.get("latency"):
        out["latency"] = _latency(res["latency"], outdir)
    soaks = [r for r in res.get("soak", []) if "series" in r]
    if soaks:
        out["soak"] = ", ".join(_soak(r, outdir) for r in soaks)
    return out


def _drain(rows: list[Result], outdir: str) -> str:
    series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if "rate" in r and r.get("processes") == 1:
            series[r["system"]][r["concurrency"]].append(r["rate"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, by_c in series.items():
        cs = sorted(by_c)
        ax.plot(cs, [statistics.median(by_c[c]) for c in cs], marker="o", label=system)
    cli = [r["rate"] for r in rows if "rate" in r and r.get("processes", 1) > 1]
    if cli:
        ax.scatter(
            [50], [statistics.median(cli)], marker="*", s=150, label="aioq CLI 2 processes x c50"
        )
    ax.set_xscale("log")
    ax.set_xlabel("worker concurrency")
    ax.set_ylabel("jobs/s (median)")
    ax.set_title("drain: no-op jobs per second")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "drain.png"), dpi=100)
    plt.close(fig)
    return "drain.png"


def _latency(rows: list[Result], outdir: str) -> str:
    samples: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        label = (
            r["system"]
            if r.get("mode") in ("notify", "default")
            else f"{r['system']} ({r.get('mode')})"
        )
        samples[label] += [max(x, 0.01) for x in r.get("samples_ms", [])]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, s in samples.items():
        s = sorted(s)
        if s:
            ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("commit to task start, ms (log)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("latency CDF, idle worker, one job every 20 ms")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "latency_cdf.png"), dpi=100)
    plt.close(fig)
    return "latency_cdf.png"


def _soak(r: Result, outdir: str) -> str:
    s = r["series"]
    t = [x["t"] for x in s]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a1.plot(t, [x["p50_ms"] for x in s], label="p50")
    a1.plot(t, [x["p99_ms"] for x in s], label="p99")
    a1.set_yscale("log")
    a1.set_ylabel("latency ms (per second)")
    a1.legend()
    a1.grid(True, alpha=0.3)
    a2.plot(t, [x["n_dead_tup"] for x in s], label="dead tuples")
    a2.plot(t, [x["backlog"] for x in s], label="backlog (rows)")
    a2.set_ylabel("rows")
    a2.set_xlabel("seconds")
    a3 = a2.twinx()
    a3.plot(
        t, [(x["table_bytes"] + x["index_bytes"]) / 1024 for x in s], "k--", label="table+index kB"
    )
    a3.set_ylabel("kB")
    a2.legend(loc="upper left")
    a3.legend(loc="upper right")
    a2.grid(True, alpha=0.3)
    fig.suptitle(f"soak: aioq at {r['target_rate']:,.0f} jobs/s")
    fig.tight_layout()
    name = f"soak_{r['target_rate']:.0f}.png"
    fig.savefig(os.path.join(outdir, name), dpi=100)
    plt.close(fig)
    return name
