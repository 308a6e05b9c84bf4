"""The per-minute outcome history and the workers' rows (aioq.worker.history writes them; the
dashboard and `aioq stats` read them). docs/architecture.md, "Tables"."""

from __future__ import annotations

from dataclasses import dataclass

from aioq.sql import Statement, columns, nothing

__all__ = (
    "BIN_ORIGIN",
    "FORGET_WORKER",
    "HIST_WIDTH",
    "PRUNE_STATS",
    "RECENT_OUTCOMES",
    "RECORD_STATS",
    "ROLLUP_STEP",
    "RecentOutcomes",
)

ROLLUP_STEP = 1800.0
"""The period of a stats_rollup row (schema.sql, migration 9), in seconds: the history summed
over workers per half hour, what the throughput page's day view reads."""

BIN_ORIGIN = "timestamptz '2000-01-01'"
"""Where the rollup's bins start (SQL): a step that is a multiple of ROLLUP_STEP bins them whole."""

HIST_WIDTH = 17
"""Buckets of the wait and run histograms (aioq.worker.history.BUCKETS + 1)."""

# Add the new counts and histograms (excluded) to a history row (h), bucket by bucket.
_ADD_COUNTS = """
SET completed = h.completed + excluded.completed,
    retried = h.retried + excluded.retried,
    dead = h.dead + excluded.dead,
    wait_hist = (SELECT array_agg(a + b ORDER BY i)
                 FROM unnest(h.wait_hist, excluded.wait_hist) WITH ORDINALITY AS x(a, b, i)),
    run_hist = (SELECT array_agg(a + b ORDER BY i)
                FROM unnest(h.run_hist, excluded.run_hist) WITH ORDINALITY AS x(a, b, i))"""

# One statement a minute per worker: upsert its row in workers ($1 id, $2 host, $3 pid,
# $4 queues, $5 concurrency), add its counts to the current minute and to the current half hour
# of the rollup. $6..$10 are parallel arrays, one element per (queue, task); $11/$12 the wait
# and run histograms of all of them flattened, $13 buckets each. Every worker adds to the same
# rollup rows: each locks them in (queue, task) order, so two workers' writes may wait for
# each other but never deadlock.
RECORD_STATS = Statement(
    f"""
WITH me AS (
    INSERT INTO {{s}}.workers AS w (id, host, pid, queues, concurrency)
    VALUES ($1, $2, $3, $4::text[], $5)
    ON CONFLICT (id) DO UPDATE
    SET last_seen = now(), queues = excluded.queues, concurrency = excluded.concurrency
),
counts AS (
    SELECT c.queue, c.task, c.completed, c.retried, c.dead,
           ($11::integer[])[(c.n - 1) * $13 + 1:c.n * $13] AS wait_hist,
           ($12::integer[])[(c.n - 1) * $13 + 1:c.n * $13] AS run_hist
    FROM unnest($6::text[], $7::text[], $8::integer[], $9::integer[], $10::integer[])
         WITH ORDINALITY AS c(queue, task, completed, retried, dead, n)
),
rolled AS (
    INSERT INTO {{s}}.stats_rollup AS h
        (minute, queue, task, completed, retried, dead, wait_hist, run_hist)
    SELECT date_bin(make_interval(secs => {ROLLUP_STEP:g}), now(), {BIN_ORIGIN}),
           queue, task, completed, retried, dead, wait_hist, run_hist
    FROM counts
    ORDER BY queue, task
    ON CONFLICT (minute, queue, task) DO UPDATE{_ADD_COUNTS}
)
INSERT INTO {{s}}.stats_history AS h
    (minute, worker, queue, task, completed, retried, dead, wait_hist, run_hist)
SELECT date_trunc('minute', now()), $1, queue, task, completed, retried, dead, wait_hist,
       run_hist
FROM counts
ON CONFLICT (minute, worker, queue, task) DO UPDATE{_ADD_COUNTS}
""",
    nothing,
)

# History older than $1 seconds, at most $2 rows a statement (and as many of the rollup's half
# hours that ended before then); and workers not seen for as long (a worker killed without a
# clean stop leaves its row behind).
PRUNE_STATS = Statement(
    f"""
WITH gone AS (
    DELETE FROM {{s}}.workers WHERE last_seen < now() - make_interval(secs => $1::float8)
),
rolled AS (
    DELETE FROM {{s}}.stats_rollup
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {{s}}.stats_rollup
        WHERE minute < now() - make_interval(secs => $1::float8 + {ROLLUP_STEP:g})
        LIMIT $2
    ))
)
DELETE FROM {{s}}.stats_history
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {{s}}.stats_history
    WHERE minute < now() - make_interval(secs => $1::float8)
    LIMIT $2
))
""",
    nothing,
)

# A worker stopped cleanly: its row ($1) goes.
FORGET_WORKER = Statement("DELETE FROM {s}.workers WHERE id = $1", nothing)


@dataclass(frozen=True, slots=True)
class RecentOutcomes:
    """A queue's completions and failures since the start of the previous minute."""

    queue: str
    completed: int
    failed: int


# What `aioq stats` shows as the last minute's completions and failures (workers write their
# counts once a minute).
RECENT_OUTCOMES = Statement(
    """
SELECT queue, sum(completed)::bigint AS completed, sum(retried + dead)::bigint AS failed
FROM {s}.stats_history
WHERE minute >= date_trunc('minute', now()) - interval '1 minute'
GROUP BY queue
""",
    columns(RecentOutcomes),
)
