"""The per-minute outcome history and the workers' rows (aioq.worker.history writes them; the
dashboard and `aioq stats` read them). docs/architecture.md, "Tables"."""

from __future__ import annotations

from dataclasses import dataclass

from aioq.sql import Named, Statement, columns, fragments, nothing

__all__ = (
    "BIN_ORIGIN",
    "FORGET_WORKER",
    "HIST_WIDTH",
    "PRUNE_STATS",
    "RECENT_OUTCOMES",
    "RECORD_STATS",
    "ROLLUP_STEP",
    "RecentOutcomes",
    "RecordStats",
)

ROLLUP_STEP = float(fragments.ROLLUP_STEP)
"""The period of a stats_rollup row (schema.sql, migration 9), in seconds: the history summed
over workers per half hour, what the throughput page's day view reads (``@rollup_step``)."""

BIN_ORIGIN = fragments.BIN_ORIGIN
"""Where the rollup's bins start (SQL): a step that is a multiple of ROLLUP_STEP bins them whole."""

HIST_WIDTH = 17
"""Buckets of the wait and run histograms (aioq.worker.history.BUCKETS + 1)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordStats:
    """A worker's row, and its counts since the last write: parallel lists, one element per
    (queue, task), and the wait and run histograms of all of them flattened."""

    worker: str
    host: str
    pid: int
    queues: list[str]
    concurrency: int
    queue_names: list[str]
    tasks: list[str]
    completed: list[int]
    retried: list[int]
    dead: list[int]
    wait_hist: list[int]
    run_hist: list[int]
    buckets: int  # per histogram (HIST_WIDTH)


# One statement a minute per worker: upsert its row in workers, add its counts to the current
# minute and to the current half hour of the rollup. Every worker adds to the same rollup rows:
# each locks them in (queue, task) order, so two workers' writes may wait for each other but
# never deadlock.
RECORD_STATS = Named(
    RecordStats,
    """
WITH me AS (
    INSERT INTO @schema.workers AS w (id, host, pid, queues, concurrency)
    VALUES (:worker, :host, :pid, :queues::text[], :concurrency)
    ON CONFLICT (id) DO UPDATE
    SET last_seen = now(), queues = excluded.queues, concurrency = excluded.concurrency
),
counts AS (
    SELECT c.queue, c.task, c.completed, c.retried, c.dead,
           (:wait_hist::integer[])[(c.n - 1) * :buckets + 1 : c.n * :buckets] AS wait_hist,
           (:run_hist::integer[])[(c.n - 1) * :buckets + 1 : c.n * :buckets] AS run_hist
    FROM unnest(:queue_names::text[], :tasks::text[], :completed::integer[],
                :retried::integer[], :dead::integer[])
         WITH ORDINALITY AS c(queue, task, completed, retried, dead, n)
),
rolled AS (
    INSERT INTO @schema.stats_rollup AS h
        (minute, queue, task, completed, retried, dead, wait_hist, run_hist)
    SELECT date_bin(make_interval(secs => @rollup_step), now(), @bin_origin),
           queue, task, completed, retried, dead, wait_hist, run_hist
    FROM counts
    ORDER BY queue, task
    ON CONFLICT (minute, queue, task) DO UPDATE
    @add_counts
)
INSERT INTO @schema.stats_history AS h
    (minute, worker, queue, task, completed, retried, dead, wait_hist, run_hist)
SELECT date_trunc('minute', now()), :worker, queue, task, completed, retried, dead, wait_hist,
       run_hist
FROM counts
ON CONFLICT (minute, worker, queue, task) DO UPDATE
@add_counts
""",
    nothing,
)

# History older than :age seconds, at most :limit rows a statement (and as many of the rollup's
# half hours that ended before then); and workers not seen for as long (a worker killed without
# a clean stop leaves its row behind).
PRUNE_STATS = Statement(
    """
WITH gone AS (
    DELETE FROM @schema.workers WHERE last_seen < now() - make_interval(secs => :age::float8)
),
rolled AS (
    DELETE FROM @schema.stats_rollup
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM @schema.stats_rollup
        WHERE minute < now() - make_interval(secs => :age::float8 + @rollup_step)
        LIMIT :limit
    ))
)
DELETE FROM @schema.stats_history
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM @schema.stats_history
    WHERE minute < now() - make_interval(secs => :age::float8)
    LIMIT :limit
))
""",
    nothing,
    ("age", "limit"),
)

# A worker stopped cleanly: its row goes.
FORGET_WORKER = Statement("DELETE FROM @schema.workers WHERE id = :worker", nothing, ("worker",))


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
FROM @schema.stats_history
WHERE minute >= date_trunc('minute', now()) - interval '1 minute'
GROUP BY queue
""",
    columns(RecentOutcomes),
)
