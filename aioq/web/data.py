"""What the pages show, read in bounded statements: the overview, a page of jobs, the history.

Nothing here reads more than a fixed number of rows: counts stop at ``count_cap`` and say so
(``capped``), a page of jobs reads a window of ``window`` rows along an index, the history is
a few thousand rows a day at most per worker. Opening the dashboard on a ten-million-row jobs
table costs what it costs on an empty one.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from aioq.job import JobStatus
from aioq.sql.admin import TABLE_STATS
from aioq.sql.history import ROLLUP_STEP
from aioq.sql.limits import QUEUE_SETTINGS
from aioq.stats_history import percentile
from aioq.store import Connection, Store

__all__ = (
    "STATE_COLUMNS",
    "History",
    "JobsPage",
    "Overview",
    "QueueRow",
    "load_history",
    "load_jobs",
    "load_overview",
)

# The per-queue columns of the overview after ready and scheduled, in order: each a state
# counted by DASH_STATES. A new terminal state (cancelled) is one more name here and in the SQL.
STATE_COLUMNS = ("running", "expired", "dead", "cancelled")
MAX_QUEUES = 200
MAX_PRIORITIES = 50  # distinct priorities per queue probed for the oldest ready job
MAX_WORKERS = 200

# The statuses a row of the jobs table can have: what the job list filters on (a succeeded job
# is found in the archive, by id, on its own page).
LISTED_STATUSES = tuple(s.value for s in JobStatus if s is not JobStatus.SUCCEEDED)

# What may be done to a job in each state, by the actions of the dashboard.
ACTIONS_BY_STATUS: dict[str, tuple[str, ...]] = {
    "pending": ("cancel", "delete"),
    "running": ("cancel",),  # its worker stops the run and records it cancelled
    "dead": ("retry", "delete"),
    "cancelled": ("delete",),
}


@dataclass(slots=True)
class QueueRow:
    """One queue's counts; a name in ``capped`` is a lower bound (the count stopped at the cap)."""

    queue: str
    ready: int = 0
    scheduled: int = 0
    oldest_ready_age: float = 0.0
    states: dict[str, int] = field(default_factory=dict)
    capped: set[str] = field(default_factory=set)
    # Fleet-wide settings (aioq queues set / pause): None when not set.
    max_running: int | None = None
    rate: tuple[int, float] | None = None  # at most rate[0] claims in any rate[1] seconds
    paused: bool = False


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """A worker as it last recorded itself, and the jobs it holds now."""

    id: str
    host: str | None
    pid: int | None
    queues: list[str]
    concurrency: int | None
    started_at: datetime | None
    seen_ago: float | None  # None: no row (the worker writes none), seen only through its jobs
    running: int


@dataclass(frozen=True, slots=True)
class Overview:
    """Everything on the overview page."""

    queues: list[QueueRow]
    workers: list[WorkerRow]
    table: dict[str, object]
    cap: int
    stale_after: float  # a worker not seen for this long is probably gone


async def load_overview(
    conn: Connection, store: Store, *, cap: int, stale_after: float
) -> Overview:
    """Read the per-queue counts, the workers and the jobs table's health."""
    queues: dict[str, QueueRow] = {}
    for row in await store.dash_pending(conn, MAX_QUEUES, cap, MAX_PRIORITIES):
        q = queues[row["queue"]] = QueueRow(row["queue"])
        q.ready, q.scheduled = row["ready"], row["scheduled"]
        q.oldest_ready_age = row["oldest_ready_age"]
        if row["sampled"] >= cap:
            q.capped |= {"ready", "scheduled"}
    totals: dict[str, int] = defaultdict(int)
    for row in await store.dash_states(conn, cap):  # running, expired, dead, cancelled
        q = queues.setdefault(row["queue"], QueueRow(row["queue"]))
        q.states[row["state"]] = row["n"]
        totals[row["state"]] += row["n"]
    for q in queues.values():  # the cap is per state, across queues
        q.capped |= {state for state in STATE_COLUMNS if totals[state] >= cap}
    # The queues table holds one row per queue with settings (not the jobs' counts that
    # aioq.queues() adds with a scan of the jobs table).
    for s in await QUEUE_SETTINGS.rows(conn, store.schema):
        q = queues.setdefault(s.name, QueueRow(s.name))
        q.max_running, q.paused = s.max_running, s.paused
        if s.rate_limit is not None and s.rate_period is not None:
            q.rate = (s.rate_limit, s.rate_period)
    workers = [
        WorkerRow(
            id=row["id"],
            host=row["host"],
            pid=row["pid"],
            queues=list(row["queues"] or ()),
            concurrency=row["concurrency"],
            started_at=row["started_at"],
            seen_ago=row["seen_ago"],
            running=row["running"],
        )
        for row in await store.dash_workers(conn, cap, MAX_WORKERS)
    ]
    figures = await TABLE_STATS.row(conn, store.schema)
    table: dict[str, object] = dataclasses.asdict(figures) if figures is not None else {}
    return Overview(
        queues=sorted(queues.values(), key=lambda q: q.queue),
        workers=workers,
        table=table,
        cap=cap,
        stale_after=stale_after,
    )


@dataclass(frozen=True, slots=True)
class JobsPage:
    """A page of jobs, newest first, and where the next page starts."""

    jobs: list[dict[str, object]]
    next_before: int | None  # the cursor of the next (older) page; None at the end
    scanned: int  # rows of the window read
    window_floor: int | None  # the lowest id the window reached


def status_filter(value: str | None) -> str | None:
    """Return a known status, or None for any; unknown values match nothing (never an error)."""
    if not value:
        return None
    return value if value in LISTED_STATUSES else "?"


async def load_jobs(
    conn: Connection,
    store: Store,
    *,
    before: int | None,
    status: str | None,
    queue: str | None,
    task: str | None,
    text: str | None,
    limit: int,
    window: int,
) -> JobsPage:
    """Read one page of jobs matching the filters, from at most ``window`` rows below ``before``."""
    rows = await store.dash_page(
        conn,
        before=before,
        window=window,
        status=status,
        queue=queue or None,
        task=task or None,
        text=text or None,
        limit=limit,
    )
    jobs = [dict(row.items()) for row in rows if row["id"] is not None]
    scanned, floor = rows[0]["scanned"], rows[0]["floor"]
    if len(jobs) >= limit:
        next_before: int | None = rows[len(jobs) - 1]["id"]
    elif scanned >= window:
        next_before = floor  # the window ran out first: go on below it
    else:
        next_before = None
    return JobsPage(jobs=jobs, next_before=next_before, scanned=scanned, window_floor=floor)


@dataclass(frozen=True, slots=True)
class TaskTotals:
    """Outcomes of one (queue, task) over the range, with wait and run percentiles."""

    queue: str
    task: str
    completed: int
    retried: int
    dead: int
    wait_p50: float | None
    wait_p95: float | None
    run_p50: float | None
    run_p95: float | None


@dataclass(frozen=True, slots=True)
class Series:
    """One queue's (or one task's) outcomes per step, oldest first."""

    name: str
    points: list[tuple[datetime, int, int, int]]  # (start, completed, retried, dead)
    peak: int


@dataclass(frozen=True, slots=True)
class History:
    """The throughput page: totals per (queue, task) and a series per queue (or task)."""

    queue: str | None  # the series are per task of this queue; None: per queue
    seconds: float
    step: float
    totals: list[TaskTotals]
    series: list[Series]


async def load_history(
    conn: Connection, store: Store, *, seconds: float, step: float, queue: str | None = None
) -> History:
    """Read the history of the last ``seconds`` in steps of ``step`` (one queue's, if given).

    Steps of whole half hours (the day view) read the half-hour rollup: a day of minutes is
    hundreds of thousands of rows with many workers, the rollup about fifty per queue and task.
    """
    rollup = step % ROLLUP_STEP == 0
    read_totals = store.rollup_totals if rollup else store.history_totals
    read_series = store.rollup_series if rollup else store.history_series
    totals = [
        TaskTotals(
            queue=row["queue"],
            task=row["task"],
            completed=row["completed"],
            retried=row["retried"],
            dead=row["dead"],
            wait_p50=percentile(row["wait"], 0.5),
            wait_p95=percentile(row["wait"], 0.95),
            run_p50=percentile(row["run"], 0.5),
            run_p95=percentile(row["run"], 0.95),
        )
        for row in await read_totals(conn, seconds)
        if queue is None or row["queue"] == queue
    ]
    points: dict[str, list[tuple[datetime, int, int, int]]] = defaultdict(list)
    for row in await read_series(conn, seconds, step, queue):
        points[row["name"]].append((row["t"], row["completed"], row["retried"], row["dead"]))
    series = [
        Series(name=name, points=p, peak=max(c + r + d for _, c, r, d in p))
        for name, p in sorted(points.items())
    ]
    return History(queue=queue, seconds=seconds, step=step, totals=totals, series=series)
