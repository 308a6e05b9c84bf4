"""The dashboard's statements (aioq.web), as templates; rendered by aioq.store.Store."""

from __future__ import annotations

from aioq.sql import DEFAULT_SCHEMA, quote_schema, render
from aioq.sql.history import BIN_ORIGIN as _BIN_ORIGIN
from aioq.sql.history import HIST_WIDTH, ROLLUP_STEP

__all__ = ("DEFAULT_SCHEMA", "ROLLUP_STEP", "quote_schema", "render")

# --- the dashboard (aioq.web) ---
# Every statement reads a bounded number of index entries whatever the size of the jobs table:
# counts stop at $cap rows and say so, lists read a window of rows along an index.

# Per queue with pending jobs (found by a skip scan of the claim index: one probe per queue, at
# most $1 queues): ready and scheduled among the first $2 pending jobs in claim order
# (`sampled` = $2 means the counts are lower bounds), and the oldest ready job: the first entry
# of each priority is its oldest, so one probe per priority (at most $3 priorities) finds it
# exactly, however many jobs wait.
DASH_PENDING = """
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
"""

# Jobs in the states that are not the backlog (running, dead, cancelled, expired leases), per queue, among
# at most $1 rows of each, read through each state's partial index. `state` names the count.
DASH_STATES = """
SELECT queue, state, count(*) AS n FROM (
    (SELECT queue, 'running' AS state FROM {s}.jobs WHERE status = 'running' LIMIT $1)
    UNION ALL
    (SELECT queue, 'expired' FROM {s}.jobs
     WHERE status = 'running' AND lease_expires_at < now() LIMIT $1)
    UNION ALL
    (SELECT queue, 'dead' FROM {s}.jobs WHERE status = 'dead' LIMIT $1)
    UNION ALL
    (SELECT queue, 'cancelled' FROM {s}.jobs WHERE status = 'cancelled' LIMIT $1)
) AS s
GROUP BY queue, state
"""

# The workers' rows, with the jobs each holds now (among at most $1 running rows); a worker
# without a row (it stopped writing, or predates the table) still shows through its jobs.
DASH_WORKERS = """
SELECT coalesce(w.id, r.locked_by) AS id, w.host, w.pid, w.queues, w.concurrency,
       w.started_at, extract(epoch FROM now() - w.last_seen)::float8 AS seen_ago,
       coalesce(r.running, 0) AS running
FROM {s}.workers AS w
FULL JOIN (
    SELECT locked_by, count(*) AS running
    FROM (SELECT locked_by FROM {s}.jobs WHERE status = 'running' LIMIT $1) AS x
    GROUP BY locked_by
) AS r ON r.locked_by = w.id
ORDER BY w.last_seen DESC NULLS LAST, 1
LIMIT $2
"""

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
# (jobs_cancelled_id_idx), so a page of them
# never steps over the live ones. The status is a literal: the partial index needs it.
DASH_PAGE = _DASH_PAGE.format(where="")
DASH_DEAD_PAGE = _DASH_PAGE.format(where="status = 'dead' AND")
DASH_CANCELLED_PAGE = _DASH_PAGE.format(where="status = 'cancelled' AND")

# Bounds every statement of the transaction it runs in (the dashboard's).
SET_STATEMENT_TIMEOUT = """
SELECT set_config('statement_timeout', $1, true)
"""


def _bucket_sums(column: str) -> str:
    sums = ", ".join(f"coalesce(sum({column}[{i}]), 0)" for i in range(1, HIST_WIDTH + 1))
    return f"ARRAY[{sums}]::bigint[]"


# The rows of a history table in the last $1 seconds: the minutes that began in them, or the
# rollup's half hours that overlap them.
_MINUTES_IN_WINDOW = "minute >= now() - make_interval(secs => $1::float8)"
_HALF_HOURS_IN_WINDOW = f"minute > now() - make_interval(secs => $1::float8 + {ROLLUP_STEP:g})"


def _history_totals(table: str, in_window: str) -> str:
    """Per queue and task over the last $1 seconds: outcome counts, and the wait and run
    histograms summed bucket by bucket (plain aggregates: no unnest of every row's arrays)."""
    return f"""
SELECT queue, task, sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead, {_bucket_sums("wait_hist")} AS wait,
       {_bucket_sums("run_hist")} AS run
FROM {{s}}.{table}
WHERE {in_window}
GROUP BY queue, task
ORDER BY queue, task
"""


def _history_series(table: str, in_window: str) -> str:
    """Outcome counts over the last $1 seconds in steps of $2 seconds: per queue, or with a
    queue $3 per task of that queue."""
    return f"""
SELECT date_bin(make_interval(secs => $2::float8), minute, {_BIN_ORIGIN}) AS t,
       CASE WHEN $3::text IS NULL THEN queue ELSE task END AS name,
       sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead
FROM {{s}}.{table}
WHERE {in_window} AND ($3::text IS NULL OR queue = $3)
GROUP BY 1, 2
ORDER BY 1, 2
"""


HISTORY_TOTALS = _history_totals("stats_history", _MINUTES_IN_WINDOW)
HISTORY_SERIES = _history_series("stats_history", _MINUTES_IN_WINDOW)
ROLLUP_TOTALS = _history_totals("stats_rollup", _HALF_HOURS_IN_WINDOW)
ROLLUP_SERIES = _history_series("stats_rollup", _HALF_HOURS_IN_WINDOW)
