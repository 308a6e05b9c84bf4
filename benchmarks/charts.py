"""PNG charts with matplotlib (Agg): drain, defer_conc and io_bound throughput against
concurrency, payload bars, the latency CDF and the soak's time series (with the worker's RSS)."""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Result = dict[str, Any]


def draw(res: dict[str, list[Result]], outdir: str) -> dict[str, str]:
    """Draw what the results allow; return {scenario: file name}."""
    out = {}
    if res.get("drain"):
        out["drain"] = _drain(res["drain"], outdir)
    if res.get("defer_conc"):
        out["defer_conc"] = _rates(
            res["defer_conc"], outdir, "defer_conc",
            "deferring connections (one job per transaction)",
            "defer_conc: deferring from many connections at once",
        )  # fmt: skip
    if res.get("io_bound"):
        out["io_bound"] = _rates(
            res["io_bound"], outdir, "io_bound", "worker concurrency (one process)",
            "io_bound: tasks that await 50 ms",
        )  # fmt: skip
    if res.get("payload"):
        out["payload"] = _payload(res["payload"], outdir)
    if res.get("latency"):
        out["latency"] = _latency(res["latency"], outdir)
    soaks = [r for r in res.get("soak", []) if "series" in r]
    if soaks:
        out["soak"] = ", ".join(_soak(r, outdir) for r in soaks)
    return out


def _by_system(
    rows: list[Result], param: str, field: str = "rate"
) -> dict[str, dict[Any, list[float]]]:
    """{system: {param value: [field of each repeat]}} over the rows that have both."""
    series: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get(field) is not None and param in r and "error" not in r:
            series[r["system"]][r[param]].append(r[field])
    return series


def _lines(ax: Any, series: dict[str, dict[Any, list[float]]]) -> None:
    """One line per system through the medians, the repeats' min-max as error bars (log x)."""
    for system, by_x in series.items():
        xs = sorted(by_x)
        meds = [statistics.median(by_x[x]) for x in xs]
        low = [m - min(by_x[x]) for m, x in zip(meds, xs, strict=True)]
        high = [max(by_x[x]) - m for m, x in zip(meds, xs, strict=True)]
        ax.errorbar(xs, meds, yerr=[low, high], marker="o", capsize=3, label=system)
    ticks = sorted({x for by_x in series.values() for x in by_x})
    ax.set_xscale("log")
    ax.set_xticks(ticks, [str(x) for x in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def _save(fig: Any, ax: Any, outdir: str, name: str, xlabel: str, ylabel: str, title: str) -> str:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, name), dpi=100)
    plt.close(fig)
    return name


def _drain(rows: list[Result], outdir: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _lines(ax, _by_system([r for r in rows if r.get("processes") == 1], "concurrency"))
    cli = [r["rate"] for r in rows if "rate" in r and r.get("processes", 1) > 1]
    if cli:
        ax.scatter(
            [50], [statistics.median(cli)], marker="*", s=150, label="aioq CLI 2 processes x c50"
        )
    ax.set_yscale("log")  # the systems span two orders of magnitude
    return _save(
        fig, ax, outdir, "drain.png", "worker concurrency", "jobs/s (median, min–max, log)",
        "drain: no-op jobs per second",
    )  # fmt: skip


def _rates(rows: list[Result], outdir: str, scenario: str, xlabel: str, title: str) -> str:
    """jobs/s against concurrency per system (log-log); io_bound adds its ideal line."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = _by_system(rows, "concurrency")
    _lines(ax, series)
    ideal = {r["concurrency"]: r["ideal"] for r in rows if r.get("ideal")}
    if ideal:
        cs = sorted(ideal)
        ax.plot(cs, [ideal[c] for c in cs], "k--", label="ideal (concurrency / 0.05 s)")
    ax.set_yscale("log")
    return _save(fig, ax, outdir, f"{scenario}.png", xlabel, "jobs/s (median, min–max)", title)


def _payload(rows: list[Result], outdir: str) -> str:
    sizes = sorted({r["payload_kb"] for r in rows if "payload_kb" in r})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.5))
    width = 0.8 / max(len(systems), 1)
    for ax, (field, what) in zip(
        axes, (("defer_rate", "bulk defer"), ("rate", "drain c50")), strict=True
    ):
        for k, system in enumerate(systems):
            by_kb = _by_system([r for r in rows if r["system"] == system], "payload_kb", field)
            meds = [
                statistics.median(by_kb[system][kb]) if by_kb[system][kb] else 0 for kb in sizes
            ]
            ax.bar([i + k * width for i in range(len(sizes))], meds, width, label=system)
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(sizes))])
        ax.set_xticklabels([f"{kb} KB" for kb in sizes])
        ax.set_yscale("log")
        ax.set_ylabel("jobs/s (median)")
        ax.set_title(what)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("payload: nested JSON arguments")
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "payload.png"), dpi=100)
    plt.close(fig)
    return "payload.png"


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
    return _save(
        fig, ax, outdir, "latency_cdf.png", "commit to task start, ms (log)", "fraction of jobs",
        "latency CDF, idle worker, one job every 20 ms",
    )  # fmt: skip


def _soak(r: Result, outdir: str) -> str:
    s = r["series"]
    t = [x["t"] for x in s]
    rss = [x.get("rss_mb") for x in s]
    rows = 3 if all(m is not None for m in rss) else 2
    fig, axes = plt.subplots(rows, 1, figsize=(7, 3 * rows), sharex=True)
    a1, a2 = axes[0], axes[1]
    a1.plot(t, [x["p50_ms"] for x in s], label="p50")
    a1.plot(t, [x["p99_ms"] for x in s], label="p99")
    a1.set_yscale("log")
    a1.set_ylabel("latency ms (per second)")
    a1.legend()
    a1.grid(True, alpha=0.3)
    a2.plot(t, [x["n_dead_tup"] for x in s], label="dead tuples")
    a2.plot(t, [x["backlog"] for x in s], label="backlog (rows)")
    a2.set_ylabel("rows")
    if rows == 3:
        axes[2].plot(t, rss, "g-", marker=".", label="worker RSS (MiB)")
        axes[2].set_ylabel("worker RSS, MiB")
        axes[2].set_ylim(bottom=0)
        axes[2].legend(loc="lower right")
        axes[2].grid(True, alpha=0.3)
    axes[-1].set_xlabel("seconds")
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


def soak_hour(summary: Result, series: list[Result], outdir: str) -> str:
    """The soak of benchmarks/soak.py: latencies, backlog and dead tuples, the size of every
    aioq table and index, vacuums, the worker's RSS and the server's CPU per job, against
    time; the window of the verdicts shaded. Returns the file name."""
    import soak  # the harness's own series (one definition of what is charted and judged)

    points = soak.series_of(series)
    minutes = {k: ([t / 60 for t, _ in v], [y for _, y in v]) for k, v in points.items()}
    fig, axes = plt.subplots(5, 1, figsize=(9, 17), sharex=True)
    start = (summary["seconds"] - summary["window_s"]) / 60
    for ax in axes:
        ax.axvspan(start, summary["seconds"] / 60, color="0.93", zorder=0)
        ax.grid(True, alpha=0.3)

    def line(ax: Any, key: str, label: str, **kw: Any) -> None:
        if key in minutes:
            verdict = summary["verdicts"].get(key, {}).get("flat")
            mark = "" if verdict is None else (" (flat)" if verdict else " (NOT flat)")
            ax.plot(*minutes[key], label=label + mark, linewidth=0.9, **kw)

    a = axes[0]
    line(a, "claim_p50_ms", "claim p50")
    line(a, "claim_p99_ms", "claim p99")
    line(a, "pickup_p50_ms", "pickup p50 (insert to start)")
    line(a, "pickup_p99_ms", "pickup p99")
    a.set_yscale("log")
    a.set_ylabel("ms, per sample")
    a.legend(fontsize=7, loc="upper left")
    a = axes[1]
    line(a, "backlog", "backlog (jobs enqueued, not started)")
    line(a, "dead:jobs", "dead tuples, jobs")
    line(a, "dead:results", "dead tuples, results")
    line(a, "dead:workflow_steps", "dead tuples, workflow_steps")
    a.set_ylabel("rows")
    a.legend(fontsize=7, loc="upper left")
    a = axes[2]
    last = series[-1]["sizes"]
    big = sorted(
        (k for k in points if k.startswith("size:") and max(y for _, y in points[k]) >= 0.1),
        key=lambda k: -last.get(k[5:], 0),
    )
    for k in big:
        line(a, k, k[5:])
    a.set_yscale("log")
    a.set_ylabel("MB (pg_relation_size)")
    a.legend(fontsize=6, loc="upper left", ncol=2)
    a = axes[3]
    line(a, "jobs_vacuums_per_min", "vacuums of jobs per minute (autovacuum + aioq's)", color="C3")
    a.set_ylabel("per minute")
    a.legend(fontsize=7, loc="upper left")
    a = axes[4]
    line(a, "worker_rss_mb", "worker RSS, MiB", color="g")
    a.set_ylabel("MiB")
    a.set_ylim(bottom=0)
    b = a.twinx()
    line(b, "server_cpu_ms_per_job", "server CPU per job, ms", color="C1")
    b.set_ylabel("server CPU ms / job")
    b.set_ylim(bottom=0)
    a.legend(fontsize=7, loc="lower left")
    b.legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("minutes (shaded: the window of the verdicts)")
    rate = summary["rate"]
    cap = summary.get("capacity")
    share = f" ({rate / cap:.0%} of {cap:,.0f}/s)" if cap else ""
    verdict = "every series flat" if summary.get("all_flat") else "NOT every series flat"
    fig.suptitle(
        f"soak: aioq worker c50, {rate:,.0f} jobs/s{share}, {summary['mix']} mix,"
        f" autovacuum {summary['autovacuum']}: {verdict}",
        fontsize=10,
    )
    fig.tight_layout()
    name = f"soak_{summary['minutes']:.0f}min_{summary['mix']}_av{summary['autovacuum']}.png"
    os.makedirs(outdir, exist_ok=True)
    fig.savefig(os.path.join(outdir, name), dpi=90)
    plt.close(fig)
    return name
