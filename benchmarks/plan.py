"""What each scenario measures: the list of cells (one measurement process each) per repeat."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import systems

DRAIN_CONCURRENCY = (1, 10, 50)
CLI_PROCESSES = 2
CLI_CONCURRENCY = 50
LATENCY_POLL = 0.1  # the poll interval of aioq's poll-only latency run (LISTEN off)
HISTORY_ROWS = (1_000, 1_000_000)
# Soak rates as fractions of aioq's c50 drain rate; the enqueuer shares the worker's process.
SOAK_FRACTIONS = (0.25, 0.5)
# The full run's time limits and lengths (seconds), also quoted in RESULTS.md's method.
DEFER_ONE_LIMIT = 4
DRAIN_C1_LIMIT = 3  # c1 decides no ratio: a capped peer's rate is its jobs done in this time
DRAIN_LIMIT = 30  # c10 and c50: a guard only; every system's drain is sized to end well before
# Jobs per c10 and c50 drain, per system: about 1.5 to 6 s at its rates on record (quiet or
# loaded machine), so no drain that decides a ratio is cut by the limit; aioq's 20 000 take it
# 1 to 2.5 s. c1 drains 1 000 jobs (aioq 3 000).
DRAIN_JOBS = {
    "aioq": 20_000,
    "pgqueuer": 10_000,
    "chancy": 5_000,
    "saq": 5_000,
    "arq": 5_000,
    "oban": 3_000,
    "celery": 1_000,
    "procrastinate": 500,
}
# One round only, its figure a single run: c1 cells where a peer runs into the limit in every
# run on record (quiet or loaded), and procrastinate's c10 and c50 (about 100 jobs/s, 20 to 60
# times below every other system's: never the best peer; 5 s a drain). {concurrency: systems}
DRAIN_ONCE = {
    1: ("pgqueuer", "procrastinate", "chancy", "arq", "oban", "celery"),
    10: ("procrastinate",),
    50: ("procrastinate",),
}
SOAK_SECONDS = 30
DEFER_CONC_SECONDS = 1.0
IO_WORK = 1.5  # seconds of jobs at the ideal rate
IO_LIMIT = 4
PAYLOAD_LIMIT = 5  # each phase: the defer, the drain
BACKLOG_JOBS = 1_000_000
BACKLOG_LIMIT = 60  # the drain of the ready quarter
MIXED_SECONDS = 60
REDIS_DB = {"saq": 1, "arq": 2, "celery": 4}


@dataclass
class Cell:
    scenario: str
    system: str
    argv: list[str]
    timeout: float
    params: dict[str, Any] = field(default_factory=dict)
    script: str = "measure.py"
    db: str = "fresh"  # fresh copy of the template | keep (history) | redis
    label: str = ""
    rounds: int | None = None  # at most this many rounds (None: the run's --repeats)

    @property
    def redis_db(self) -> int:
        return REDIS_DB.get(self.system, 3)

    def key(self) -> dict[str, Any]:
        return {"system": self.system, **self.params}

    def title(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.system} {extra}".strip()


def _db(name: str) -> str:
    return "redis" if name in systems.REDIS else "fresh"


def plan(
    scenario: str, names: list[str], *, quick: bool, prior: dict[str, list[dict[str, Any]]]
) -> list[Cell]:
    """The cells of one scenario, in interleaving order, each with its cap on rounds."""
    cells = _cells(scenario, names, quick=quick, prior=prior)
    for cell in cells:
        if scenario in REPEATS:
            cell.rounds = min(cell.rounds or REPEATS[scenario], REPEATS[scenario])
    return cells


def _cells(
    scenario: str, names: list[str], *, quick: bool, prior: dict[str, list[dict[str, Any]]]
) -> list[Cell]:
    base = ["--scenario", scenario]
    if scenario == "defer_one":
        n, limit = (2_000, 3) if quick else (10_000, DEFER_ONE_LIMIT)
        return [
            Cell(
                scenario,
                s,
                ["--system", s, *base, "--n", str(n), "--limit", str(limit)],
                120,
                db=_db(s),
            )
            for s in [*names, systems.REFERENCE]
        ]
    if scenario == "defer_many":
        n = 5_000 if quick else 20_000
        return [
            Cell(
                scenario,
                s,
                ["--system", s, *base, "--n", str(n), "--batch", "1000"],
                180,
                db=_db(s),
            )
            for s in [*names, systems.REFERENCE]
            if systems.load(s).bulk_api  # saq and arq have no bulk enqueue call
        ]
    if scenario == "drain":
        cells = []
        for c in DRAIN_CONCURRENCY:
            for s in names:
                if c == 1:
                    n, limit = (3_000 if s == "aioq" else 1_000), DRAIN_C1_LIMIT
                else:
                    n, limit = DRAIN_JOBS.get(s, 5_000), DRAIN_LIMIT
                if quick:
                    n = max(n // 4, 250)
                argv = ["--system", s, *base, "--n", str(n), "--concurrency", str(c)]
                params = {"concurrency": c, "processes": 1, "n": n}
                argv += ["--limit", str(limit)]
                once = 1 if s in DRAIN_ONCE.get(c, ()) else None
                cells.append(Cell(scenario, s, argv, limit + 90, params, db=_db(s), rounds=once))
        n = 5_000 if quick else 20_000
        argv = ["--system", "aioq", *base, "--n", str(n), "--concurrency", str(CLI_CONCURRENCY)]
        argv += ["--processes", str(CLI_PROCESSES), "--limit", str(DRAIN_LIMIT)]
        params = {"concurrency": CLI_CONCURRENCY, "processes": CLI_PROCESSES, "n": n}
        cells.append(Cell(scenario, "aioq", argv, DRAIN_LIMIT + 90, params))
        return cells
    if scenario == "latency":
        n = 50 if quick else 150  # aioq's 3 rounds: 450 samples, enough for a p99
        cells = []
        for s in names:
            k = n if s == "aioq" else n * 2 // 3
            argv = ["--system", s, *base, "--n", str(k), "--concurrency", "10", "--poll", "1.0"]
            cells.append(Cell(scenario, s, argv, 90, {"mode": "default"}, db=_db(s)))
        argv = ["--system", "aioq", *base, "--n", str(n), "--concurrency", "10"]
        argv += ["--no-listen", "--poll", str(LATENCY_POLL)]
        cells.append(Cell(scenario, "aioq", argv, 90, {"mode": f"poll {LATENCY_POLL:g}s"}))
        return cells
    if scenario == "history":
        rows = (1_000, 100_000) if quick else HISTORY_ROWS
        n = 2_000 if quick else 5_000
        return [
            Cell(
                scenario,
                "aioq",
                ["--system", "aioq", *base, "--rows", str(r), "--n", str(n), "--concurrency", "10"],
                600,
                {"rows": r},
                db="keep",
                label=f"hist{r}",
            )
            for r in rows
        ]
    if scenario == "soak":
        seconds = 15 if quick else SOAK_SECONDS
        cells = []
        for fraction in SOAK_FRACTIONS:
            rate = fraction * c50_rate(prior)
            argv = ["--system", "aioq", *base, "--seconds", str(seconds), "--rate", f"{rate:.0f}"]
            argv += ["--concurrency", "50"]
            argv += ["--c50-rate", f"{c50_rate(prior):.0f}"] if prior.get("drain") else []
            cells.append(Cell(scenario, "aioq", argv, seconds + 120, {"target_rate": round(rate)}))
        return cells
    if scenario == "ceiling":
        n = 20_000 if quick else 30_000
        cells = [
            Cell(
                scenario,
                "ceiling",
                ["--mode", "loop", "--connections", str(k), "--batch", "50", "--n", str(n)],
                180,
                {"tool": "asyncpg loop", "clients": k, "batch": 50},
                script="ceiling.py",
            )
            for k in (1, 4)
        ]
        for batch in (50,):
            for k in (1, 4, 8):
                total = n // k * k
                argv = ["--mode", "pgbench", "--connections", str(k), "--batch", str(batch)]
                cells.append(
                    Cell(
                        scenario,
                        "ceiling",
                        [*argv, "--n", str(total)],
                        180,
                        {"tool": "pgbench", "clients": k, "batch": batch},
                        script="ceiling.py",
                    )
                )
        for cell in cells:
            cell.system = "aioq"  # the ceiling runs on a fresh copy of aioq's database
            cell.params = {"system": "ceiling", **cell.params}
        return cells
    return plan_workload(scenario, names, quick=quick, prior=prior)


DEFER_CONC = (1, 16, 64)
IO_CONCURRENCY = (100, 500, 1000)
# The time budget: pgqueuer and oban for PostgreSQL, saq for Redis. procrastinate drains about
# 100 no-op jobs/s at any concurrency (drain), far below the ideal 2 000 to 20 000/s: every cell
# would only run into the limit. chancy and arq are left out for the budget alone. Celery's docs
# recommend another pool (gevent or eventlet) for I/O-bound tasks than the prefork one measured
# here, where c1000 would be 1 000 processes: not measured.
IO_SYSTEMS = ("aioq", "pgqueuer", "oban", "saq")
PAYLOAD_KB = (1, 64)
QUEUES = (1, 50)
PROCESSES = (1, 2, 4)
# Scenarios whose repeats are capped (the time budget of the full run, about 23 min): one long
# run, or cells whose spread is small against the ratios they show.
REPEATS = {"backlog": 1, "mixed": 1, "soak": 1, "payload": 2, "io_bound": 2, "workflow": 1}
# Typed arguments: defer_many and a c50 drain of jobs whose argument is a 10-field dataclass or
# pydantic model, against the same JSON passed as a dict (typed_values.py).
TYPED_SHAPES = ("plain", "dataclass", "pydantic")
TYPED_JOBS = 20_000
# The workflow: one fan-out of WORKFLOW_STEPS steps and one fan-in, the worker at c50.
WORKFLOW_STEPS = 10_000
WORKFLOW_LIMIT = 300


def plan_workload(
    scenario: str, names: list[str], *, quick: bool, prior: dict[str, list[dict[str, Any]]]
) -> list[Cell]:
    """The cells of the issue-16 scenarios (workloads.py)."""
    base = ["--scenario", scenario]
    pg = [s for s in names if s in systems.POSTGRES]
    if scenario == "defer_conc":
        seconds = DEFER_CONC_SECONDS
        return [
            Cell(
                scenario,
                s,
                ["--system", s, *base, "--concurrency", str(c), "--seconds", str(seconds)],
                120,
                {"concurrency": c},
            )
            for c in DEFER_CONC
            for s in [*pg, systems.REFERENCE]
        ]
    if scenario == "io_bound":
        work = 1.0 if quick else IO_WORK
        limit = 4 if quick else IO_LIMIT
        cells = []
        for c in IO_CONCURRENCY:
            n = int(c / 0.05 * work)
            for s in names:
                if s not in IO_SYSTEMS:
                    continue
                argv = ["--system", s, *base, "--n", str(n), "--concurrency", str(c)]
                argv += ["--limit", str(limit)]
                cells.append(Cell(scenario, s, argv, limit + 120, {"concurrency": c}, db=_db(s)))
        return cells
    if scenario == "payload":
        cells = []
        for kb in PAYLOAD_KB:
            n = (2_000 if quick else 5_000) if kb <= 4 else (200 if quick else 400)
            for s in pg:
                argv = ["--system", s, *base, "--n", str(n), "--payload-kb", str(kb)]
                argv += ["--limit", str(4 if quick else PAYLOAD_LIMIT)]
                cells.append(Cell(scenario, s, argv, 150, {"payload_kb": kb}))
        return cells
    if scenario == "backlog":
        n = 100_000 if quick else BACKLOG_JOBS
        argv = ["--system", "aioq", *base, "--n", str(n), "--limit", str(BACKLOG_LIMIT)]
        return [Cell(scenario, "aioq", argv, 400, {"n": n})]
    if scenario == "queues":
        n = 5_000 if quick else 10_000
        return [
            Cell(
                scenario,
                "aioq",
                ["--system", "aioq", *base, "--n", str(n), "--queues", str(q), "--limit", "30"],
                120,
                {"queues": q},
            )
            for q in QUEUES
        ]
    if scenario == "processes":
        n = 10_000 if quick else 20_000
        return [
            Cell(
                scenario,
                "aioq",
                [
                    *["--system", "aioq", *base, "--n", str(n), "--processes", str(p)],
                    *["--concurrency", "50", "--limit", "30"],
                ],
                120,
                {"processes": p},
            )
            for p in PROCESSES
        ]
    if scenario == "workflow":
        # Every system whose adapter has a workflow (``workflow_api``, ``run_workflow``).
        n = 2_000 if quick else WORKFLOW_STEPS
        return [
            Cell(
                scenario,
                s,
                [*["--system", s, *base, "--n", str(n), "--concurrency", "50"],
                 *["--limit", str(WORKFLOW_LIMIT)]],
                WORKFLOW_LIMIT + 90,
                {"n": n},
                db=_db(s),
            )
            for s in names
            if systems.load(s).workflow_api
        ]  # fmt: skip
    if scenario == "typed":
        # The three shapes interleave (run.py runs a scenario's cells in turn, round by round):
        # the ratios to "plain" come from medians measured side by side.
        n = 5_000 if quick else TYPED_JOBS
        return [
            Cell(
                scenario,
                "aioq",
                [*["--system", "aioq", *base, "--shape", shape, "--n", str(n)],
                 *["--batch", "1000", "--concurrency", "50"]],
                240,
                {"shape": shape},
            )
            for shape in TYPED_SHAPES
        ]  # fmt: skip
    if scenario == "mixed":
        seconds = 15 if quick else MIXED_SECONDS
        n = 20_000 if quick else 100_000
        argv = ["--system", "aioq", *base, "--n", str(n), "--seconds", str(seconds)]
        return [Cell(scenario, "aioq", argv, seconds + 120)]
    raise ValueError(scenario)


def c50_rate(prior: dict[str, list[dict[str, Any]]]) -> float:
    """aioq's c50 drain median measured in this run (4 000/s if drain did not run)."""
    rates = [
        r["rate"]
        for r in prior.get("drain", [])
        if r.get("system") == "aioq"
        and r.get("concurrency") == 50
        and r.get("processes") == 1
        and "rate" in r
    ]
    return statistics.median(rates) if rates else 4000.0
