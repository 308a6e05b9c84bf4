"""The dashboard's own reads, each declared once as a :class:`~aioq.sql.Statement` with its row.

Every statement reads a bounded number of index entries whatever the size of the jobs table:
counts stop at a cap and say so, lists read a window of rows along an index, the history is a
few thousand rows a day at most per worker (tests/test_web_plans.py EXPLAINs each of them on a
quarter of a million jobs). A row type's fields are its statement's columns, by name. Called
directly: ``await DASH_STATES.rows(conn, schema, cap)``. A pending job's order is the claim's
(``@claim_order``), the pending rows read along the claim's index.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.sql import Named, Statement, columns, nothing
from aioq.sql.history import HIST_WIDTH

__all__ = (
    "DASH_CANCELLED_PAGE",
    "DASH_DEAD_PAGE",
    "DASH_PAGE",
    "DASH_PENDING",
    "DASH_STATES",
    "DASH_UNKNOWN_TASKS",
    "DASH_WORKERS",
    "HISTORY_SERIES",
    "HISTORY_TOTALS",
    "HIST_WIDTH",
    "ROLLUP_SERIES",
    "ROLLUP_TOTALS",
    "SET_STATEMENT_TIMEOUT",
    "DashPage",
    "PageRow",
    "PendingRow",
    "SeriesRow",
    "StateRow",
    "TotalsRow",
    "UnknownRow",
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
# most :queues queues): ready and scheduled among the first :cap pending jobs in claim order,
# and the oldest ready job: the first entry of each priority is its oldest, so one probe per
# priority (at most :priorities) finds it exactly, however many jobs wait.
DASH_PENDING = Statement(
    """
WITH RECURSIVE names(queue, n) AS (
    (SELECT queue, 1 FROM @schema.jobs WHERE status = 'pending' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM @schema.jobs AS j
            WHERE j.status = 'pending' AND j.queue > names.queue
            ORDER BY j.queue LIMIT 1),
           names.n + 1
    FROM names WHERE names.queue IS NOT NULL AND names.n < :queues
)
SELECT names.queue, p.ready, p.scheduled, p.sampled,
       coalesce(extract(epoch FROM now() - o.oldest_ready), 0)::float8 AS oldest_ready_age
FROM names
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE s.run_at <= now()) AS ready,
           count(*) FILTER (WHERE s.run_at > now()) AS scheduled,
           count(*) AS sampled
    FROM (SELECT run_at FROM @schema.jobs
          WHERE status = 'pending' AND queue = names.queue
          ORDER BY @claim_order
          LIMIT :cap) AS s
) AS p
CROSS JOIN LATERAL (
    WITH RECURSIVE firsts(priority, run_at, n) AS (
        (SELECT priority, run_at, 1 FROM @schema.jobs
         WHERE status = 'pending' AND queue = names.queue
         ORDER BY @claim_order LIMIT 1)
        UNION ALL
        SELECT nx.priority, nx.run_at, firsts.n + 1
        FROM firsts
        CROSS JOIN LATERAL (
            SELECT j.priority, j.run_at FROM @schema.jobs AS j
            WHERE j.status = 'pending' AND j.queue = names.queue AND j.priority < firsts.priority
            ORDER BY @claim_order LIMIT 1
        ) AS nx
        WHERE firsts.n < :priorities
    )
    SELECT min(run_at) FILTER (WHERE run_at <= now()) AS oldest_ready FROM firsts
) AS o
WHERE names.queue IS NOT NULL
ORDER BY names.queue
""",
    columns(PendingRow),
    ("queues", "cap", "priorities"),
)


@dataclass(frozen=True, slots=True)
class StateRow:
    """How many jobs of a queue are in a state: waiting (a workflow step), running, expired (a
    running job whose lease ran out), dead or cancelled."""

    queue: str
    state: str
    n: int


# The states that are not the backlog, per queue, among at most :cap rows of each, read through
# each state's partial index (waiting steps through the workflow steps' index).
DASH_STATES = Statement(
    """
SELECT queue, state, count(*) AS n FROM (
    (SELECT queue, 'running' AS state FROM @schema.jobs WHERE status = 'running' LIMIT :cap)
    UNION ALL
    (SELECT queue, 'waiting' FROM @schema.jobs
     WHERE workflow_id IS NOT NULL AND status = 'waiting' LIMIT :cap)
    UNION ALL
    (SELECT queue, 'expired' FROM @schema.jobs
     WHERE status = 'running' AND lease_expires_at < now() LIMIT :cap)
    UNION ALL
    (SELECT queue, 'dead' FROM @schema.jobs WHERE status = 'dead' LIMIT :cap)
    UNION ALL
    (SELECT queue, 'cancelled' FROM @schema.jobs WHERE status = 'cancelled' LIMIT :cap)
) AS s
GROUP BY queue, state
""",
    columns(StateRow),
    ("cap",),
)


@dataclass(frozen=True, slots=True)
class UnknownRow:
    """Jobs of a task and queue waiting for a worker that knows their task, among at most
    ``cap`` such jobs (a lower bound when the sample is full), and since when the first has."""

    queue: str
    task: str
    n: int
    since: datetime
    sampled: int  # the jobs of every task read: the cap when there are more


# Jobs waiting for a worker that knows their task (docs/architecture.md, "Unknown tasks"), at
# most :cap of them read, through the partial index that holds them alone.
DASH_UNKNOWN_TASKS = Statement(
    """
SELECT queue, task, count(*) AS n, min(unknown_since) AS since,
       sum(count(*)) OVER ()::integer AS sampled
FROM (SELECT queue, task, unknown_since FROM @schema.jobs
      WHERE unknown_since IS NOT NULL AND status = 'pending' LIMIT :cap) AS u
GROUP BY queue, task
ORDER BY queue, task
""",
    columns(UnknownRow),
    ("cap",),
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


# The workers' rows, with the jobs each holds now (among at most :cap running rows); a worker
# without a row still shows through its jobs. At most :limit workers, the latest seen first.
DASH_WORKERS = Statement(
    """
SELECT coalesce(w.id, r.locked_by) AS id, w.host, w.pid, w.queues, w.concurrency,
       w.started_at, extract(epoch FROM now() - w.last_seen)::float8 AS seen_ago,
       coalesce(r.running, 0) AS running,
       extract(epoch FROM r.lease_end - now())::float8 AS lease_left
FROM @schema.workers AS w
FULL JOIN (
    SELECT locked_by, count(*) AS running, max(lease_expires_at) AS lease_end
    FROM (SELECT locked_by, lease_expires_at FROM @schema.jobs
          WHERE status = 'running' LIMIT :cap) AS x
    GROUP BY locked_by
) AS r ON r.locked_by = w.id
ORDER BY w.last_seen DESC NULLS LAST, 1
LIMIT :limit
""",
    columns(WorkerSeen),
    ("cap", "limit"),
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


@dataclass(frozen=True, slots=True, kw_only=True)
class DashPage:
    """What a page of jobs reads: the window and the filters (None: any)."""

    before: int | None  # the cursor: ids below it (None: from the newest)
    window: int  # at most this many rows read
    status: str | None
    queue: str | None
    task: str | None
    text: str | None  # in last_error, any case
    limit: int  # at most this many matches


# A page of jobs, newest first, keyset on id: a window of at most :window rows below the cursor
# along an index ordered by id, then the filters and at most :limit matches. The window's floor
# and size tell the caller where to go on when the window ran out before the page was full.
# Always one row (the job columns NULL when nothing matched). Along the primary key; dead
# (cancelled) jobs alone along jobs_dead_id_idx (jobs_cancelled_id_idx), so a page of them never
# steps over the live ones: the status is a literal there, which the partial index needs.
DASH_PAGE = Named(
    DashPage,
    """
WITH win AS MATERIALIZED (
    SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, locked_by,
           last_error, created_at, progress
    FROM @schema.jobs
    WHERE id < coalesce(:before::bigint, 9223372036854775807)
    ORDER BY id DESC
    LIMIT :window
)
@page_matches
""",
    columns(PageRow),
)

DASH_DEAD_PAGE = Named(
    DashPage,
    """
WITH win AS MATERIALIZED (
    SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, locked_by,
           last_error, created_at, progress
    FROM @schema.jobs
    WHERE status = 'dead' AND id < coalesce(:before::bigint, 9223372036854775807)
    ORDER BY id DESC
    LIMIT :window
)
@page_matches
""",
    columns(PageRow),
)

DASH_CANCELLED_PAGE = Named(
    DashPage,
    """
WITH win AS MATERIALIZED (
    SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, locked_by,
           last_error, created_at, progress
    FROM @schema.jobs
    WHERE status = 'cancelled' AND id < coalesce(:before::bigint, 9223372036854775807)
    ORDER BY id DESC
    LIMIT :window
)
@page_matches
""",
    columns(PageRow),
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


# The rows of a history table in the last :seconds: the minutes that began in them
# (stats_history), or the rollup's half hours that overlap them (stats_rollup). Totals: per
# queue and task, outcome counts and the wait and run histograms summed bucket by bucket.
# Series: outcome counts in steps of :step seconds, per queue, or with a :queue per task of
# that queue; steps start on the rollup's bin origin, so a step that is a multiple of
# ROLLUP_STEP bins its half hours whole.
HISTORY_TOTALS = Statement(
    """
SELECT queue, task, sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead,
       @wait_hist_sums AS wait,
       @run_hist_sums AS run
FROM @schema.stats_history
WHERE minute >= now() - make_interval(secs => :seconds::float8)
GROUP BY queue, task
ORDER BY queue, task
""",
    columns(TotalsRow),
    ("seconds",),
)

HISTORY_SERIES = Statement(
    """
SELECT date_bin(make_interval(secs => :step::float8), minute, @bin_origin) AS t,
       CASE WHEN :queue::text IS NULL THEN queue ELSE task END AS name,
       sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead
FROM @schema.stats_history
WHERE minute >= now() - make_interval(secs => :seconds::float8)
  AND (:queue::text IS NULL OR queue = :queue)
GROUP BY 1, 2
ORDER BY 1, 2
""",
    columns(SeriesRow),
    ("seconds", "step", "queue"),
)

ROLLUP_TOTALS = Statement(
    """
SELECT queue, task, sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead,
       @wait_hist_sums AS wait,
       @run_hist_sums AS run
FROM @schema.stats_rollup
WHERE minute > now() - make_interval(secs => :seconds::float8 + @rollup_step)
GROUP BY queue, task
ORDER BY queue, task
""",
    columns(TotalsRow),
    ("seconds",),
)

ROLLUP_SERIES = Statement(
    """
SELECT date_bin(make_interval(secs => :step::float8), minute, @bin_origin) AS t,
       CASE WHEN :queue::text IS NULL THEN queue ELSE task END AS name,
       sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead
FROM @schema.stats_rollup
WHERE minute > now() - make_interval(secs => :seconds::float8 + @rollup_step)
  AND (:queue::text IS NULL OR queue = :queue)
GROUP BY 1, 2
ORDER BY 1, 2
""",
    columns(SeriesRow),
    ("seconds", "step", "queue"),
)

# --- the transaction every page runs in ---

# The bound ('3000ms'): every statement of the current transaction, and only of it.
SET_STATEMENT_TIMEOUT = Statement(
    """
SELECT set_config('statement_timeout', :timeout, true)
""",
    nothing,
    ("timeout",),
)
