"""The dashboard's own reads, each declared once as a :class:`~aioq.sql.Statement` with its row.

Every statement reads a bounded number of index entries whatever the size of the jobs table:
counts stop at a cap and say so, lists read a window of rows along an index, the history is a
few thousand rows a day at most per worker (tests/test_web_plans.py EXPLAINs each of them on a
quarter of a million jobs). A row type's fields are its statement's columns, by name. Called
directly: ``await DASH_STATES.rows(conn, schema, cap)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.sql import Statement, columns, nothing
from aioq.sql.history import BIN_ORIGIN, HIST_WIDTH, ROLLUP_STEP

__all__ = (
    "DASH_CANCELLED_PAGE",
    "DASH_DEAD_PAGE",
    "DASH_PAGE",
    "DASH_PENDING",
    "DASH_STATES",
    "DASH_WORKERS",
    "HISTORY_SERIES",
    "HISTORY_TOTALS",
    "HIST_WIDTH",
    "ROLLUP_SERIES",
    "ROLLUP_TOTALS",
    "SET_STATEMENT_TIMEOUT",
    "PageRow",
    "PendingRow",
    "SeriesRow",
    "StateRow",
    "TotalsRow",
    "WorkerSeen",
)

# --- the overview ---


@dataclass(frozen=True, slots=True)
class PendingRow:
    """A queue with pending jobs: ready and scheduled among the first ``sampled`` in claim order
    (``sampled`` = the cap: they are lower bounds), and the age of its oldest ready job."""

    queue: str
    ready: int
    scheduled: int
    sampled: int
    oldest_ready_age: float


# Per queue with pending jobs (found by a skip scan of the claim index: one probe per queue, at
# most $1 queues): ready and scheduled among the first $2 pending jobs in claim order, and the
# oldest ready job: the first entry of each priority is its oldest, so one probe per priority
# (at most $3 priorities) finds it exactly, however many jobs wait.
DASH_PENDING = Statement(
    """
WITH RECURSIVE names(queue, n) AS (
    (SELECT queue, 1 FROM {s}.jobs WHERE status = 'pending' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM {s}.jobs AS j
            WHERE j.status = 'pending' AND j.queue > names.queue
            ORDER BY j.queue LIMIT 1),
           names.n + 1
    FROM names WHERE names.queue IS NOT NULL AND names.n < $1
)
SELECT names.queue, p.ready, p.scheduled, p.sampled,
       coalesce(extract(epoch FROM now() - o.oldest_ready), 0)::float8 AS oldest_ready_age
FROM names
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE s.run_at <= now()) AS ready,
           count(*) FILTER (WHERE s.run_at > now()) AS scheduled,
           count(*) AS sampled
    FROM (SELECT run_at FROM {s}.jobs
          WHERE status = 'pending' AND queue = names.queue
          ORDER BY priority DESC, run_at, id
          LIMIT $2) AS s
) AS p
CROSS JOIN LATERAL (
    WITH RECURSIVE firsts(priority, run_at, n) AS (
        (SELECT priority, run_at, 1 FROM {s}.jobs
         WHERE status = 'pending' AND queue = names.queue
         ORDER BY priority DESC, run_at, id LIMIT 1)
        UNION ALL
        SELECT nx.priority, nx.run_at, firsts.n + 1
        FROM firsts
        CROSS JOIN LATERAL (
            SELECT j.priority, j.run_at FROM {s}.jobs AS j
            WHERE j.status = 'pending' AND j.queue = names.queue AND j.priority < firsts.priority
            ORDER BY j.priority DESC, j.run_at, j.id LIMIT 1
        ) AS nx
        WHERE firsts.n < $3
    )
    SELECT min(run_at) FILTER (WHERE run_at <= now()) AS oldest_ready FROM firsts
) AS o
WHERE names.queue IS NOT NULL
ORDER BY names.queue
""",
    columns(PendingRow),
)


@dataclass(frozen=True, slots=True)
class StateRow:
    """How many jobs of a queue are in a state: waiting (a workflow step), running, expired (a
    running job whose lease ran out), dead or cancelled."""

    queue: str
    state: str
    n: int


# The states that are not the backlog, per queue, among at most $1 rows of each, read through
# each state's partial index (waiting steps through the workflow steps' index).
DASH_STATES = Statement(
    """
SELECT queue, state, count(*) AS n FROM (
    (SELECT queue, 'running' AS state FROM {s}.jobs WHERE status = 'running' LIMIT $1)
    UNION ALL
    (SELECT queue, 'waiting' FROM {s}.jobs
     WHERE workflow_id IS NOT NULL AND status = 'waiting' LIMIT $1)
    UNION ALL
    (SELECT queue, 'expired' FROM {s}.jobs
     WHERE status = 'running' AND lease_expires_at < now() LIMIT $1)
    UNION ALL
    (SELECT queue, 'dead' FROM {s}.jobs WHERE status = 'dead' LIMIT $1)
    UNION ALL
    (SELECT queue, 'cancelled' FROM {s}.jobs WHERE status = 'cancelled' LIMIT $1)
) AS s
GROUP BY queue, state
""",
    columns(StateRow),
)


@dataclass(frozen=True, slots=True)
class WorkerSeen:
    """A worker as its row in ``workers`` and the jobs it holds show it.

    ``seen_ago`` is None for a worker with no row (it writes none: ``stats_history=False``)
    that shows through its jobs only; ``lease_left`` is the seconds until the latest lease of
    its jobs expires (negative: expired), None when it holds none.
    """

    id: str
    host: str | None
    pid: int | None
    queues: list[str] | None
    concurrency: int | None
    started_at: datetime | None
    seen_ago: float | None
    running: int
    lease_left: float | None


# The workers' rows, with the jobs each holds now (among at most $1 running rows); a worker
# without a row still shows through its jobs. At most $2 workers, the latest seen first.
DASH_WORKERS = Statement(
    """
SELECT coalesce(w.id, r.locked_by) AS id, w.host, w.pid, w.queues, w.concurrency,
       w.started_at, extract(epoch FROM now() - w.last_seen)::float8 AS seen_ago,
       coalesce(r.running, 0) AS running,
       extract(epoch FROM r.lease_end - now())::float8 AS lease_left
FROM {s}.workers AS w
FULL JOIN (
    SELECT locked_by, count(*) AS running, max(lease_expires_at) AS lease_end
    FROM (SELECT locked_by, lease_expires_at FROM {s}.jobs
          WHERE status = 'running' LIMIT $1) AS x
    GROUP BY locked_by
) AS r ON r.locked_by = w.id
ORDER BY w.last_seen DESC NULLS LAST, 1
LIMIT $2
""",
    columns(WorkerSeen),
)

# --- the job list ---


@dataclass(frozen=True, slots=True)
class PageRow:
    """A row of a page of jobs: the window read (``floor``, ``scanned``) and one job of the
    page, its columns None when nothing in the window matched (the statement's only row)."""

    floor: int | None
    scanned: int
    id: int | None
    queue: str | None
    task: str | None
    status: str | None
    priority: int | None
    run_at: datetime | None
    attempts: int | None
    max_attempts: int | None
    locked_by: str | None
    error: str | None  # the first 300 characters of last_error
    created_at: datetime | None
    progress: float | None


# A page of jobs, newest first, keyset on id: a window of at most $2 rows below the cursor $1
# along an index ordered by id, then the filters ($3 status, $4 queue, $5 task, $6 text in
# last_error) and at most $7 matches. The window's floor and size tell the caller where to go
# on when the window ran out before the page was full. Always one row (the job columns NULL
# when nothing matched).
_DASH_PAGE = """
WITH win AS MATERIALIZED (
    SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, locked_by,
           last_error, created_at, progress
    FROM {{s}}.jobs
    WHERE {where} id < coalesce($1::bigint, 9223372036854775807)
    ORDER BY id DESC
    LIMIT $2
)
SELECT w.floor, w.scanned, m.*
FROM (SELECT min(id) AS floor, count(*) AS scanned FROM win) AS w
LEFT JOIN LATERAL (
    SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, locked_by,
           left(last_error, 300) AS error, created_at, progress
    FROM win
    WHERE ($3::text IS NULL OR status = $3)
      AND ($4::text IS NULL OR queue = $4)
      AND ($5::text IS NULL OR task = $5)
      AND ($6::text IS NULL OR strpos(lower(last_error), lower($6)) > 0)
    ORDER BY id DESC
    LIMIT $7
) AS m ON true
ORDER BY m.id DESC
"""
# Along the primary key; dead (cancelled) jobs alone along jobs_dead_id_idx
# (jobs_cancelled_id_idx), so a page of them never steps over the live ones. The status is a
# literal: the partial index needs it.
DASH_PAGE = Statement(_DASH_PAGE.format(where=""), columns(PageRow))
DASH_DEAD_PAGE = Statement(_DASH_PAGE.format(where="status = 'dead' AND"), columns(PageRow))
DASH_CANCELLED_PAGE = Statement(
    _DASH_PAGE.format(where="status = 'cancelled' AND"), columns(PageRow)
)

# --- the throughput page: the per-minute history and its half-hour rollup ---


@dataclass(frozen=True, slots=True)
class TotalsRow:
    """Outcomes of one (queue, task) over the range; histograms of waits and runs (BUCKETS)."""

    queue: str
    task: str
    completed: int
    retried: int
    dead: int
    wait: list[int]
    run: list[int]


@dataclass(frozen=True, slots=True)
class SeriesRow:
    """Outcomes of one queue (or one task of a queue) in the step that starts at ``t``."""

    t: datetime
    name: str
    completed: int
    retried: int
    dead: int


def _bucket_sums(column: str) -> str:
    sums = ", ".join(f"coalesce(sum({column}[{i}]), 0)" for i in range(1, HIST_WIDTH + 1))
    return f"ARRAY[{sums}]::bigint[]"


# The rows of a history table in the last $1 seconds: the minutes that began in them, or the
# rollup's half hours that overlap them.
_MINUTES_IN_WINDOW = "minute >= now() - make_interval(secs => $1::float8)"
_HALF_HOURS_IN_WINDOW = f"minute > now() - make_interval(secs => $1::float8 + {ROLLUP_STEP:g})"


def _history_totals(table: str, in_window: str) -> Statement[TotalsRow]:
    """Per queue and task over the last $1 seconds: outcome counts, and the wait and run
    histograms summed bucket by bucket (plain aggregates: no unnest of every row's arrays)."""
    return Statement(
        f"""
SELECT queue, task, sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead, {_bucket_sums("wait_hist")} AS wait,
       {_bucket_sums("run_hist")} AS run
FROM {{s}}.{table}
WHERE {in_window}
GROUP BY queue, task
ORDER BY queue, task
""",
        columns(TotalsRow),
    )


def _history_series(table: str, in_window: str) -> Statement[SeriesRow]:
    """Outcome counts over the last $1 seconds in steps of $2 seconds: per queue, or with a
    queue $3 per task of that queue. Steps start on the rollup's bin origin, so a step that is
    a multiple of ROLLUP_STEP bins its half hours whole."""
    return Statement(
        f"""
SELECT date_bin(make_interval(secs => $2::float8), minute, {BIN_ORIGIN}) AS t,
       CASE WHEN $3::text IS NULL THEN queue ELSE task END AS name,
       sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead
FROM {{s}}.{table}
WHERE {in_window} AND ($3::text IS NULL OR queue = $3)
GROUP BY 1, 2
ORDER BY 1, 2
""",
        columns(SeriesRow),
    )


HISTORY_TOTALS = _history_totals("stats_history", _MINUTES_IN_WINDOW)
HISTORY_SERIES = _history_series("stats_history", _MINUTES_IN_WINDOW)
ROLLUP_TOTALS = _history_totals("stats_rollup", _HALF_HOURS_IN_WINDOW)
ROLLUP_SERIES = _history_series("stats_rollup", _HALF_HOURS_IN_WINDOW)

# --- the transaction every page runs in ---

# $1 the bound ('3000ms'): every statement of the current transaction, and only of it.
SET_STATEMENT_TIMEOUT = Statement(
    """
SELECT set_config('statement_timeout', $1, true)
""",
    nothing,
)
