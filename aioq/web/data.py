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

from aioq.db import Connection
from aioq.job import JobStatus
from aioq.sql.admin import TABLE_STATS
from aioq.sql.history import ROLLUP_STEP
from aioq.sql.limits import QUEUE_SETTINGS
from aioq.web.sql import (
    DASH_CANCELLED_PAGE,
    DASH_DEAD_PAGE,
    DASH_PAGE,
    DASH_PENDING,
    DASH_STATES,
    DASH_UNKNOWN_TASKS,
    DASH_WORKERS,
    HISTORY_SERIES,
    HISTORY_TOTALS,
    ROLLUP_SERIES,
    ROLLUP_TOTALS,
    DashPage,
    PageRow,
    UnknownRow,
    WorkerSeen,
)
from aioq.worker.history import percentile

__all__ = (
    "STATE_COLUMNS",
    "History",
    "JobsPage",
    "Overview",
    "QueueRow",
    "WorkerRow",
    "is_alive",
    "load_history",
    "load_jobs",
    "load_overview",
)

# The per-queue columns of the overview after ready and scheduled, in order: each a state
# counted by DASH_STATES. A new terminal state (cancelled) is one more name here and in the SQL.
STATE_COLUMNS = ("waiting", "running", "expired", "dead", "cancelled")
MAX_QUEUES = 200
MAX_PRIORITIES = 50  # distinct priorities per queue probed for the oldest ready job
MAX_WORKERS = 200

# The statuses a row of the jobs table can have: what the job list filters on (a succeeded job
# is found in the archive, by id, on its own page).
LISTED_STATUSES = tuple(s.value for s in JobStatus if s is not JobStatus.SUCCEEDED)

# What may be done to a job in each state, by the actions of the dashboard.
ACTIONS_BY_STATUS: dict[str, tuple[str, ...]] = {
    "pending": ("cancel", "delete"),
    "waiting": ("cancel",),  # a workflow step: deleting it would strand its dependents
    "running": ("cancel",),  # its worker stops the run and records it cancelled
    "dead": ("replay", "delete"),
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
    """A worker as it last recorded itself, the jobs it holds now, and whether it is alive."""

    id: str
    host: str | None
    pid: int | None
    queues: list[str]
    concurrency: int | None
    started_at: datetime | None
    seen_ago: float | None  # None: no row (the worker writes none), seen only through its jobs
    running: int
    alive: bool


def is_alive(worker: WorkerSeen, stale_after: float) -> bool:
    """Whether a worker is alive: its row was written within ``stale_after`` seconds; or, for a
    worker that writes no row, it holds a lease that has not expired.

    A worker writes its row once a ``stats_interval`` (60 s, jittered by a tenth), so
    ``stale_after`` is one and a half of them: a killed worker shows alive for at most
    ``stale_after`` after its last write. Its leases are no sign of life while it has a row: a
    lease may run for hours after its worker died. A worker with no row shows alive until the
    latest lease of its jobs expires, as the reaper sees it.
    """
    if worker.seen_ago is not None:
        return worker.seen_ago < stale_after
    return worker.lease_left is not None and worker.lease_left > 0


@dataclass(frozen=True, slots=True)
class Overview:
    """Everything on the overview page."""

    queues: list[QueueRow]
    workers: list[WorkerRow]
    table: dict[str, object]
    cap: int
    # Jobs waiting for a worker that knows their task, per queue and task.
    unknown_tasks: list[UnknownRow] = field(default_factory=list)

    @property
    def alive(self) -> int:
        """How many workers are alive."""
        return sum(w.alive for w in self.workers)


async def load_overview(conn: Connection, schema: str, *, cap: int, stale_after: float) -> Overview:
    """Read the per-queue counts, the workers and the jobs table's health."""
    queues: dict[str, QueueRow] = {}
    for pending in await DASH_PENDING.rows(conn, schema, MAX_QUEUES, cap, MAX_PRIORITIES):
        q = queues[pending.queue] = QueueRow(pending.queue)
        q.ready, q.scheduled = pending.ready, pending.scheduled
        q.oldest_ready_age = pending.oldest_ready_age
        if pending.sampled >= cap:
            q.capped |= {"ready", "scheduled"}
    totals: dict[str, int] = defaultdict(int)
    for state in await DASH_STATES.rows(conn, schema, cap):  # running, expired, dead, cancelled
        q = queues.setdefault(state.queue, QueueRow(state.queue))
        q.states[state.state] = state.n
        totals[state.state] += state.n
    for q in queues.values():  # the cap is per state, across queues
        q.capped |= {state for state in STATE_COLUMNS if totals[state] >= cap}
    # The queues table holds one row per queue with settings (not the jobs' counts that
    # aioq.admin.queues() adds with a scan of the jobs table).
    for s in await QUEUE_SETTINGS.rows(conn, schema):
        q = queues.setdefault(s.name, QueueRow(s.name))
        q.max_running, q.paused = s.max_running, s.paused
        if s.rate_limit is not None and s.rate_period is not None:
            q.rate = (s.rate_limit, s.rate_period)
    workers = [
        WorkerRow(
            id=seen.id,
            host=seen.host,
            pid=seen.pid,
            queues=list(seen.queues or ()),
            concurrency=seen.concurrency,
            started_at=seen.started_at,
            seen_ago=seen.seen_ago,
            running=seen.running,
            alive=is_alive(seen, stale_after),
        )
        for seen in await DASH_WORKERS.rows(conn, schema, cap, MAX_WORKERS)
    ]
    figures = await TABLE_STATS.row(conn, schema)
    table: dict[str, object] = dataclasses.asdict(figures) if figures is not None else {}
    return Overview(
        queues=sorted(queues.values(), key=lambda q: q.queue),
        workers=workers,
        table=table,
        cap=cap,
        unknown_tasks=await DASH_UNKNOWN_TASKS.rows(conn, schema, cap),
    )


@dataclass(frozen=True, slots=True)
class JobsPage:
    """A page of jobs, newest first, and where the next page starts."""

    jobs: list[PageRow]
    next_before: int | None  # the cursor of the next (older) page; None at the end
    scanned: int  # rows of the window read
    window_floor: int | None  # the lowest id the window reached


def status_filter(value: str | None) -> str | None:
    """Return a known status, or None for any; unknown values match nothing (never an error)."""
    if not value:
        return None
    return value if value in LISTED_STATUSES else "?"


# A page of dead (cancelled) jobs reads along their own index, never over the live ones.
_PAGE_BY_STATUS = {"dead": DASH_DEAD_PAGE, "cancelled": DASH_CANCELLED_PAGE}


async def load_jobs(
    conn: Connection,
    schema: str,
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
    statement = _PAGE_BY_STATUS.get(status or "", DASH_PAGE)
    page = DashPage(
        before=before,
        window=window,
        status=status,
        queue=queue or None,
        task=task or None,
        text=text or None,
        limit=limit,
    )
    rows = await statement.rows(conn, schema, page)
    jobs = [row for row in rows if row.id is not None]
    scanned, floor = rows[0].scanned, rows[0].floor
    if len(jobs) >= limit:
        next_before: int | None = jobs[-1].id
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
    conn: Connection, schema: str, *, seconds: float, step: float, queue: str | None = None
) -> History:
    """Read the history of the last ``seconds`` in steps of ``step`` (one queue's, if given).

    Steps of whole half hours (the day view) read the half-hour rollup: a day of minutes is
    hundreds of thousands of rows with many workers, the rollup about fifty per queue and task.
    """
    rollup = step % ROLLUP_STEP == 0
    read_totals = ROLLUP_TOTALS if rollup else HISTORY_TOTALS
    read_series = ROLLUP_SERIES if rollup else HISTORY_SERIES
    totals = [
        TaskTotals(
            queue=row.queue,
            task=row.task,
            completed=row.completed,
            retried=row.retried,
            dead=row.dead,
            wait_p50=percentile(row.wait, 0.5),
            wait_p95=percentile(row.wait, 0.95),
            run_p50=percentile(row.run, 0.5),
            run_p95=percentile(row.run, 0.95),
        )
        for row in await read_totals.rows(conn, schema, seconds)
        if queue is None or row.queue == queue
    ]
    points: dict[str, list[tuple[datetime, int, int, int]]] = defaultdict(list)
    for row in await read_series.rows(conn, schema, seconds, step, queue):
        points[row.name].append((row.t, row.completed, row.retried, row.dead))
    series = [
        Series(name=name, points=p, peak=max(c + r + d for _, c, r, d in p))
        for name, p in sorted(points.items())
    ]
    return History(queue=queue, seconds=seconds, step=step, totals=totals, series=series)
