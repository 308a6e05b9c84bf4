"""Every SQL statement aioq runs, as a named template, and nothing else.

Templates are plain strings: ``{s}`` stands for the quoted schema name and ``{channel}`` for
the schema's LISTEN channel as a string literal (see :func:`render`). Values are always bind
parameters. Every write after the claim is fenced on the claim's identity ``(id, claims,
locked_by, status = 'running')``: ``claims`` only grows, so a worker that lost its lease, or
retries a write whose reply it never saw, changes nothing.
"""

from __future__ import annotations

import re

from aioq.errors import ConfigError

DEFAULT_SCHEMA = "aioq"
"""The schema aioq uses unless told otherwise."""

SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,57}$")


def quote_schema(schema: str) -> str:
    """Validate a schema name and return it quoted as an identifier."""
    if not SCHEMA_NAME.fullmatch(schema):
        raise ConfigError(
            "schema",
            f"{schema!r} is not a valid schema name (letters, digits and _, at most 58 characters,"
            " not starting with a digit)",
        )
    return f'"{schema}"'


def channel_name(schema: str) -> str:
    """Return the LISTEN channel of a schema; ``ring_doorbell()`` in schema.sql builds the same."""
    return f"aioq:{schema}"


def control_channel(schema: str) -> str:
    """Return the schema's control channel: cancel requests for running jobs, payload the job id.

    Five characters of prefix like the doorbell's, so any valid schema name fits PostgreSQL's
    63-byte channel names.
    """
    return f"aioq!{schema}"


def results_channel(schema: str) -> str:
    """Return the schema's results channel: a job someone may await has ended, payload its id."""
    return f"aioq={schema}"


# The payload of a notification that queue limits changed (aioq.set_queue): not a queue name,
# since queue names are never empty.
LIMITS_CHANGED = ""


def render(template: str, schema: str) -> str:
    """Fill a statement template with the quoted schema name and its channel literal."""
    # Both are safe to splice: quote_schema() admits letters, digits and _ only.
    return template.replace("{s}", quote_schema(schema)).replace(
        "{channel}", f"'{channel_name(schema)}'"
    )


INSERT_JOB = """
INSERT INTO {s}.jobs (queue, task, args, priority, run_at, max_attempts, lease, traceparent)
VALUES ($1, $2, $3::text::jsonb, $4,
        coalesce($5::timestamptz, now() + make_interval(secs => $6::float8)),
        $7, make_interval(secs => $8::float8), $9)
RETURNING id
"""

# The common case (every option at the table's default, store.TABLE_DEFAULTS): three parameters
# to encode, send and bind, the rest from the column defaults in schema.sql. TaskCall.defer
# picks it (JobOptions.at_defaults); a test keeps the two in step.
INSERT_DEFAULT_JOB = """
INSERT INTO {s}.jobs (queue, task, args) VALUES ($1, $2, $3::text::jsonb) RETURNING id
"""

# ON CONFLICT waits for a concurrent insert of the same key to commit; if the existing row was
# committed after this statement's snapshot, no id comes back and the caller asks again.
INSERT_UNIQUE_JOB = """
WITH inserted AS (
    INSERT INTO {s}.jobs
        (queue, task, args, priority, run_at, max_attempts, lease, traceparent, unique_key)
    VALUES ($1, $2, $3::text::jsonb, $4,
            coalesce($5::timestamptz, now() + make_interval(secs => $6::float8)),
            $7, make_interval(secs => $8::float8), $9, $10)
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND status IN ('pending', 'running')
    DO NOTHING
    RETURNING id
)
SELECT id FROM inserted
UNION ALL
SELECT id FROM {s}.jobs
WHERE unique_key = $10 AND status IN ('pending', 'running') AND NOT EXISTS (SELECT FROM inserted)
LIMIT 1
"""

INSERT_JOBS = """
INSERT INTO {s}.jobs (queue, task, args, priority, run_at, max_attempts, lease, traceparent)
SELECT $1, $2, a.args::jsonb, $3,
       coalesce($4::timestamptz, now() + make_interval(secs => $5::float8)),
       $6, make_interval(secs => $7::float8), $9
FROM unnest($8::text[]) WITH ORDINALITY AS a(args, n)
ORDER BY a.n
RETURNING id
"""

# What a claim returns: Claim.from_row reads these (the limited claim returns the same).
_CLAIMED = """j.id, j.claims, j.queue, j.task, j.args::text AS args, j.priority, j.attempts,
          j.max_attempts, j.snoozes, extract(epoch FROM j.lease)::float8 AS lease,
          extract(epoch FROM j.locked_at - j.run_at)::float8 AS waited, j.traceparent,
          j.scheduled_at"""

# `id = ANY(ARRAY(...))` rather than a join with picked: the prepared statement's generic
# plan guesses LIMIT $2 at a tenth of the ready rows, and with a join it then hashes a
# sequential scan of the whole table on every claim (6 ms at a 30 000-job backlog, against
# 0.1 ms). The array is looked up in the primary key whatever the estimate.
_CLAIM_SET = (
    """
UPDATE {s}.jobs AS j
SET status = 'running', attempts = j.attempts + 1, claims = j.claims + 1, locked_by = $3,
    locked_at = now(), lease_expires_at = now() + j.lease
WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING """
    + _CLAIMED
    + "\n"
)

# One queue: the index's leading column is an equality, so the scan reads in claim order.
CLAIM_ONE_QUEUE = (
    """
WITH picked AS (
    SELECT id FROM {s}.jobs
    WHERE status = 'pending' AND queue = $1 AND run_at <= now()
    ORDER BY priority DESC, run_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)"""
    + _CLAIM_SET
)

# Several queues: the same ordered index scan per queue (each reads at most $2 rows), then a
# sort of those few. `queue = ANY(...)` instead would sort every ready row of the queues.
# Rows locked here but cut by the outer LIMIT stay pending; their locks end with the statement.
CLAIM_QUEUES = (
    """
WITH picked AS (
    SELECT p.id FROM unnest($1::text[]) AS q(queue)
    CROSS JOIN LATERAL (
        SELECT id, priority, run_at FROM {s}.jobs
        WHERE status = 'pending' AND queue = q.queue AND run_at <= now()
        ORDER BY priority DESC, run_at, id
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ) AS p
    ORDER BY p.priority DESC, p.run_at, p.id
    LIMIT $2
)"""
    + _CLAIM_SET
)

# The fenced writes: $1 job ids, $2 their claim numbers, $3 this worker's id. Each first locks
# its rows in one order (ORDER BY id) in a CTE, so the heartbeat, the completer's writes and a
# release never wait on each other in opposite orders (a deadlock). The claim and the reaper
# take their rows with SKIP LOCKED: they never wait, so they cannot take part in one.
# A NOTIFY per queue whose rows became ready is sent at commit by the `rang` CTEs; PostgreSQL
# runs a data-modifying or volatile CTE only if the statement reads it, hence the
# `WHERE (SELECT count(*) FROM rang) >= 0`, which is always true but makes it read `rang`.

COMPLETE = """
WITH mine AS (
    SELECT j.id FROM {s}.jobs AS j
    JOIN unnest($1::bigint[], $2::integer[]) AS f(id, claim) ON j.id = f.id
    WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
)
DELETE FROM {s}.jobs AS j
USING mine
WHERE j.id = mine.id
RETURNING j.id
"""

COMPLETE_ARCHIVED = """
WITH mine AS (
    SELECT j.id FROM {s}.jobs AS j
    JOIN unnest($1::bigint[], $2::integer[]) AS f(id, claim) ON j.id = f.id
    WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
),
done AS (
    DELETE FROM {s}.jobs AS j
    USING mine
    WHERE j.id = mine.id
    RETURNING j.*
)
INSERT INTO {s}.archive (id, queue, task, args, priority, attempts, max_attempts, worker,
                         created_at, started_at, finished_at)
SELECT id, queue, task, args, priority, attempts, max_attempts, locked_by,
       created_at, locked_at, clock_timestamp()
FROM done
RETURNING id
"""

HEARTBEAT = """
WITH mine AS (
    SELECT j.id FROM {s}.jobs AS j
    JOIN unnest($1::bigint[], $2::integer[]) AS f(id, claim) ON j.id = f.id
    WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
)
UPDATE {s}.jobs AS j
SET lease_expires_at = now() + j.lease
FROM mine
WHERE j.id = mine.id
RETURNING j.id
"""

# Back to pending after $4 seconds. $5 is the error to record (NULL keeps the last one).
# $6 refunds the attempt (a release: the run did not happen, or did not finish). $7 marks a
# snooze (aioq.Retry): the run counts as an attempt, and max_attempts grows by one so that
# snoozing never spends the failure budget (as Oban does).
RESCHEDULE = """
WITH mine AS (
    SELECT j.id, f.delay, f.error, f.refund, f.snooze FROM {s}.jobs AS j
    JOIN unnest($1::bigint[], $2::integer[], $4::float8[], $5::text[], $6::boolean[],
                $7::boolean[]) AS f(id, claim, delay, error, refund, snooze) ON j.id = f.id
    WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
),
changed AS (
    UPDATE {s}.jobs AS j
    -- jobcontrol: a job whose cancel was requested is never run again (cancelled, not pending)
    SET status = CASE WHEN j.cancel_requested_at IS NULL THEN 'pending' ELSE 'cancelled' END,
        run_at = now() + make_interval(secs => m.delay),
        last_error = coalesce(m.error, j.last_error),
        attempts = j.attempts - CASE WHEN m.refund THEN 1 ELSE 0 END,
        max_attempts = j.max_attempts + CASE WHEN m.snooze THEN 1 ELSE 0 END,
        snoozes = j.snoozes + CASE WHEN m.snooze THEN 1 ELSE 0 END,
        last_worker = j.locked_by, locked_by = NULL, locked_at = NULL, lease_expires_at = NULL
    FROM mine AS m
    WHERE j.id = m.id
    RETURNING j.id, j.queue, m.delay = 0 AND j.status = 'pending' AS ready
),
rang AS (
    SELECT pg_notify({channel}, queue) FROM changed WHERE ready GROUP BY queue
)
SELECT id FROM changed WHERE (SELECT count(*) FROM rang) >= 0
"""

BURY = """
WITH mine AS (
    SELECT j.id, f.error FROM {s}.jobs AS j
    JOIN unnest($1::bigint[], $2::integer[], $4::text[]) AS f(id, claim, error) ON j.id = f.id
    WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
)
UPDATE {s}.jobs AS j
SET status = 'dead', last_error = m.error, run_at = now(),  -- when it died: the pruner's clock
    last_worker = j.locked_by, locked_by = NULL, locked_at = NULL, lease_expires_at = NULL
FROM mine AS m
WHERE j.id = m.id
RETURNING j.id
"""

# Every row still running under this worker's id ($1) goes back to pending with its attempt
# refunded, except the jobs in $2 (the claims it holds). On shutdown (keeping only jobs whose
# thread still runs), and after a claim whose reply was lost: this covers the claims the
# worker never saw.
RELEASE_WORKER = """
WITH mine AS (
    SELECT id FROM {s}.jobs
    WHERE locked_by = $1 AND status = 'running' AND id <> ALL($2::bigint[])
    ORDER BY id
    FOR UPDATE
),
changed AS (
    UPDATE {s}.jobs AS j
    -- jobcontrol: a job whose cancel was requested ends cancelled, never pending
    SET status = CASE WHEN j.cancel_requested_at IS NULL THEN 'pending' ELSE 'cancelled' END,
        run_at = now(), attempts = greatest(j.attempts - 1, 0),
        last_worker = j.locked_by, locked_by = NULL, locked_at = NULL, lease_expires_at = NULL
    FROM mine
    WHERE j.id = mine.id
    RETURNING j.id, j.queue
),
rang AS (
    SELECT pg_notify({channel}, queue) FROM changed GROUP BY queue
)
SELECT id FROM changed WHERE (SELECT count(*) FROM rang) >= 0
"""

# Expired leases: back to pending, or dead when the attempts are spent. Bounded per pass.
# $2: the reaping worker, whose own claims are left alone: a late heartbeat (an event loop
# blocked by a task) must not make a worker rescue the jobs it is running, and a list of the
# claims it holds would be stale by the time the statement runs. Other workers rescue them
# if it is really gone; its own orphans (a claim whose reply was lost) it releases itself.
REAP = """
WITH expired AS (
    SELECT id FROM {s}.jobs
    WHERE status = 'running' AND lease_expires_at < now()
      AND locked_by IS DISTINCT FROM $2::text
    ORDER BY lease_expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
changed AS (
    UPDATE {s}.jobs AS j
    -- jobcontrol: a rescued job whose cancel was requested ends cancelled, never pending.
    SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                      WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'pending' END,
        run_at = now(),
        last_error = format('LeaseExpired: worker %s held attempt %s past its lease', j.locked_by,
                            j.attempts),
        last_worker = j.locked_by, locked_by = NULL, locked_at = NULL, lease_expires_at = NULL
    FROM expired
    WHERE j.id = expired.id
    RETURNING j.id, j.queue, j.status, j.status = 'pending' AS ready
),
rang AS (
    SELECT pg_notify({channel}, queue) FROM changed WHERE ready GROUP BY queue
)
SELECT id, status FROM changed WHERE (SELECT count(*) FROM rang) >= 0
"""

# Dead jobs back to pending with fresh attempts. unique_key is unique
# among live jobs, so of the dead jobs sharing a key only the newest comes back, and none while a
# live job holds the key; every matching dead job is returned with what happened to it, so the
# caller can say why one was left. `newest` is a window over `locked` because FOR UPDATE and
# window functions cannot share a SELECT. The final WHERE only forces `rang` (and its NOTIFY) to
# run: a CTE nobody reads is skipped.
REPLAY_DEAD = """
WITH locked AS (
    SELECT j.id, j.queue, j.unique_key FROM {s}.jobs AS j
    WHERE j.status = 'dead'
      AND ($1::bigint[] IS NULL OR j.id = ANY($1))
      AND ($2::text IS NULL OR j.task = $2)
      AND ($3::text IS NULL OR j.queue = $3)
    FOR UPDATE
),
matching AS (
    SELECT l.id, l.unique_key, max(l.id) OVER (PARTITION BY l.unique_key) AS newest,
           (SELECT live.id FROM {s}.jobs AS live
            WHERE live.unique_key = l.unique_key AND live.status IN ('pending', 'running')
            LIMIT 1) AS live_id
    FROM locked AS l
),
changed AS (
    UPDATE {s}.jobs AS j
    SET status = 'pending', attempts = 0, run_at = now(),
        cancel_requested_at = NULL  -- jobcontrol: a request that came too late ends with the run
    FROM matching AS m
    WHERE j.id = m.id AND (m.unique_key IS NULL OR (m.live_id IS NULL AND m.id = m.newest))
    RETURNING j.id, j.queue
),
rang AS (
    SELECT pg_notify({channel}, queue) FROM changed GROUP BY queue
)
SELECT m.id, m.unique_key, c.id IS NOT NULL AS replayed, m.live_id, m.newest
FROM matching AS m
LEFT JOIN changed AS c ON c.id = m.id
WHERE (SELECT count(*) FROM rang) >= 0
ORDER BY m.id
"""

_JOB_COLUMNS = """id, queue, task, args::text AS args, status, priority, run_at, attempts,
       max_attempts, extract(epoch FROM lease)::float8 AS lease, locked_by, locked_at,
       lease_expires_at, last_error, unique_key, created_at, cancel_requested_at, progress,
       progress_note, NULL::text AS result, last_worker"""

# A job that succeeded and stored a result has left the jobs table for results (jobcontrol).
GET_JOB = f"""
SELECT {_JOB_COLUMNS}, NULL::timestamptz AS finished_at
FROM {{s}}.jobs WHERE id = $1
UNION ALL
SELECT id, queue, task, args::text, 'succeeded', priority, started_at, attempts, max_attempts,
       NULL, worker, started_at, NULL, NULL, NULL, created_at, NULL, progress, progress_note,
       result::text, worker, finished_at
FROM {{s}}.results WHERE id = $1
LIMIT 1
"""

LIST_JOBS = f"""
SELECT {_JOB_COLUMNS}
FROM {{s}}.jobs
WHERE ($1::text IS NULL OR status = $1)
  AND ($2::text IS NULL OR task = $2)
  AND ($3::text IS NULL OR queue = $3)
ORDER BY id
LIMIT $4
"""

INSTALLED_VERSION = """
SELECT coalesce(max(version), 0) FROM {s}.migrations
"""

SCHEMA_EXISTS = """
SELECT to_regclass($1) IS NOT NULL
"""

LOCK_SCHEMA = """
SELECT pg_advisory_xact_lock(hashtext($1))
"""

RECORD_MIGRATION = """
INSERT INTO {s}.migrations (version) VALUES ($1)
"""

# Retention: archived rows finished more than $1 seconds ago, at most $2 per statement, so no
# statement runs long or holds many locks; SKIP LOCKED lets every worker prune at once.
PRUNE_ARCHIVE = """
WITH deleted AS (
    DELETE FROM {s}.archive
    WHERE id IN (
        SELECT id FROM {s}.archive
        WHERE finished_at < now() - make_interval(secs => $1::float8)
        ORDER BY finished_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
"""

# Kept terminal jobs of status $3 ('dead' or 'cancelled') have no finished_at: their age is
# counted from run_at, which burial (BURY, REAP) and cancellation set to when they ended.
PRUNE_ENDED = """
WITH deleted AS (
    DELETE FROM {s}.jobs
    WHERE id IN (
        SELECT id FROM {s}.jobs
        WHERE status = $3 AND run_at < now() - make_interval(secs => $1::float8)
        ORDER BY run_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
"""

# Per queue: what the metrics gauges show. One scan of the hot table (the backlog plus dead
# jobs), so it is sampled on an interval, never per scrape.
QUEUE_STATS = """
SELECT queue,
       count(*) FILTER (WHERE status = 'pending' AND run_at <= now()) AS ready,
       count(*) FILTER (WHERE status = 'pending' AND run_at > now()) AS scheduled,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
       count(*) FILTER (WHERE status = 'running' AND lease_expires_at < now()) AS expired,
       coalesce(extract(epoch FROM now() - min(run_at)
                FILTER (WHERE status = 'pending' AND run_at <= now())), 0)::float8
           AS oldest_ready_age
FROM {s}.jobs
GROUP BY queue
ORDER BY queue
"""

# --- inspection and steering (admin, CLI) ---

# Completions in the last minute, per queue; no rows at all when the archive is empty
# (completed jobs are deleted unless a worker keeps them, so an empty archive says nothing).
ARCHIVE_STATS = """
SELECT a.queue, count(*) FILTER (WHERE a.finished_at > now() - interval '1 minute') AS completed
FROM {s}.archive AS a
WHERE EXISTS (SELECT FROM {s}.archive)
GROUP BY a.queue
"""

# $1 the qualified table name. Sizes in bytes; vacuum figures from the statistics collector.
TABLE_STATS = """
SELECT pg_table_size(c.oid) AS table_bytes, pg_indexes_size(c.oid) AS index_bytes,
       s.n_live_tup, s.n_dead_tup, s.last_autovacuum, s.last_vacuum, s.last_autoanalyze
FROM pg_class AS c
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE c.oid = $1::regclass
"""

# Dead tuples of the jobs table, and whether this role may vacuum it (owner or member).
JOBS_DEAD_TUPLES = """
SELECT coalesce(s.n_dead_tup, 0) AS dead, pg_has_role(c.relowner, 'USAGE') AS owner
FROM pg_class AS c
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE c.oid = '{s}.jobs'::regclass
"""

# SKIP_LOCKED: when another worker (or autovacuum) is vacuuming the table, skip it at once.
VACUUM_JOBS = "VACUUM (SKIP_LOCKED) {s}.jobs"

# --- per-minute history and the workers' rows (aioq.stats_history) ---

# The period of a stats_rollup row (schema.sql, migration 9): the history summed over workers
# per half hour, what the throughput page's day view reads (its step). Bins start on the same
# origin as HISTORY_SERIES's date_bin, so a step that is a multiple of this one bins them whole.
ROLLUP_STEP = 1800.0
_BIN_ORIGIN = "timestamptz '2000-01-01'"

# Add the new counts and histograms (excluded) to a history row (h), bucket by bucket.
_ADD_COUNTS = """
SET completed = h.completed + excluded.completed,
    retried = h.retried + excluded.retried,
    dead = h.dead + excluded.dead,
    wait_hist = (SELECT array_agg(a + b ORDER BY i)
                 FROM unnest(h.wait_hist, excluded.wait_hist) WITH ORDINALITY AS x(a, b, i)),
    run_hist = (SELECT array_agg(a + b ORDER BY i)
                FROM unnest(h.run_hist, excluded.run_hist) WITH ORDINALITY AS x(a, b, i))"""

# One statement a minute per worker: upsert its row in workers, add its counts to the current
# minute and to the current half hour of the rollup. $6..$10 are parallel arrays, one element
# per (queue, task); $11/$12 the wait and run histograms of all of them flattened, $13 buckets
# each. Every worker adds to the same rollup rows: each locks them in (queue, task) order, so
# two workers' writes may wait for each other but never deadlock.
RECORD_STATS = f"""
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
    SELECT date_bin(make_interval(secs => {ROLLUP_STEP:g}), now(), {_BIN_ORIGIN}),
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
"""

# History older than $1 seconds, at most $2 rows a statement (and as many of the rollup's half
# hours that ended before then); and workers not seen for as long (a worker killed without a
# clean stop leaves its row behind).
PRUNE_STATS = f"""
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
"""

FORGET_WORKER = """
DELETE FROM {s}.workers WHERE id = $1
"""

# Outcomes per queue since the start of the previous minute: what `aioq stats` shows as the
# last minute's completions and failures (workers write their counts once a minute).
RECENT_OUTCOMES = """
SELECT queue, sum(completed)::bigint AS completed, sum(retried + dead)::bigint AS failed
FROM {s}.stats_history
WHERE minute >= date_trunc('minute', now()) - interval '1 minute'
GROUP BY queue
"""

# Delete pending, dead or cancelled jobs by id (a running job belongs to its worker: cancel it
# first); return the ids.
DELETE_JOBS = """
DELETE FROM {s}.jobs
WHERE id = ANY($1::bigint[]) AND status IN ('pending', 'dead', 'cancelled')
RETURNING id
"""

# Buckets of the wait and run histograms in stats_history (aioq.stats_history.BUCKETS + 1).
HIST_WIDTH = 17


# --- periodic jobs (aioq/schedule.py) ---

# $1 schedule names. The database's clock comes with the rows: ticks are judged by it.
SCHEDULE_STATE = """
SELECT clock_timestamp() AS now, n.name, s.last_tick
FROM unnest($1::text[]) AS n(name)
LEFT JOIN {s}.schedules AS s ON s.name = n.name
"""

# First sight of a schedule: record its latest past tick as done, so its first job is the
# next tick. A worker that finds the row already there changes nothing.
SCHEDULE_START = """
INSERT INTO {s}.schedules (name, task, queue, spec, last_tick, next_tick)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (name) DO NOTHING
RETURNING name
"""

# Enqueue ticks $5 (ascending) of schedule $1 once: the UPDATE advances last_tick only while it
# is older than the first of them, and the jobs are inserted only if it did. Two workers racing:
# the second waits for the first's row lock, re-reads the row it committed, and matches nothing.
# A late worker whose tick already ran (its job deleted) matches nothing either.
SCHEDULE_TICK = """
WITH advanced AS (
    UPDATE {s}.schedules
    SET task = $2, queue = $3, spec = $4, last_tick = ($5::timestamptz[])[cardinality($5::timestamptz[])], next_tick = $6,
        updated_at = now()
    WHERE name = $1 AND last_tick < ($5::timestamptz[])[1]
    RETURNING name
)
INSERT INTO {s}.jobs (queue, task, args, priority, run_at, max_attempts, lease, scheduled_at)
SELECT $3, $2, $7::text::jsonb, $8, t.tick, $9, make_interval(secs => $10::float8), t.tick
FROM unnest($5::timestamptz[]) WITH ORDINALITY AS t(tick, n)
WHERE EXISTS (SELECT FROM advanced)
ORDER BY t.n
RETURNING id
"""

LIST_SCHEDULES = """
SELECT name, task, queue, spec, last_tick, next_tick, updated_at
FROM {s}.schedules
ORDER BY name
"""

# --- queue limits and pauses (aioq/limits.py) ---

_LIMITED = "(max_running IS NOT NULL OR rate_limit IS NOT NULL OR paused)"

# Which of a worker's queues go through the limited claim; read about once a second.
LIMITED_QUEUES = f"""
SELECT name, extract(epoch FROM rate_period)::float8 AS rate_period FROM {{s}}.queues WHERE name = ANY($1::text[]) AND {_LIMITED}
"""

# The first statement of a limited claim's transaction: take the queue's turn. Whoever held it
# before has committed once this returns, so the next statement (a new snapshot) sees its claims.
LOCK_QUEUE = f"""
SELECT {_LIMITED} AS limited FROM {{s}}.queues WHERE name = $1 FOR NO KEY UPDATE
"""

# The claim of a limited queue, run right after LOCK_QUEUE in the same transaction: as many
# jobs as the queue has room for (none while paused; max_running minus its running jobs; the
# rate's limit minus the claims counted in the last period), then the claims are counted in the
# current slot and slots past the period are dropped. $1 queue, $2 wanted, $3 worker id.
# One row per job claimed, or one row with a NULL id when none was; rate_room on every row
# is what the rate allowed (NULL: no rate), for the worker to know the rate held it back.
# Claim times are clock_timestamp() (not the transaction's start): the turns are serialized,
# so each claim's time is after the claims it counted. The UPDATE and its RETURNING are
# _CLAIM_SET's (claim identity included).
CLAIM_LIMITED = (
    """
WITH counted_room AS MATERIALIZED (
    SELECT t.now, q.rate_limit, q.rate_period, q.paused,
           extract(epoch FROM q.rate_period) / 10 AS slot_s,
           CASE WHEN q.max_running IS NOT NULL THEN q.max_running - (
               SELECT count(*) FROM {s}.jobs WHERE queue = $1 AND status = 'running') END
               AS running_room,
           CASE WHEN q.rate_limit IS NOT NULL THEN q.rate_limit - (
               SELECT coalesce(sum(c.claims), 0) FROM {s}.queue_claims AS c
               WHERE c.queue = $1 AND c.slot_end > t.now - q.rate_period) END AS rate_room
    FROM {s}.queues AS q, (SELECT clock_timestamp() AS now) AS t
    WHERE q.name = $1
),
room AS MATERIALIZED (
    SELECT r.*,
           CASE WHEN r.paused THEN 0 ELSE greatest(0, least($2, r.running_room, r.rate_room)) END
               AS n
    FROM counted_room AS r
),
picked AS (
    SELECT id FROM {s}.jobs
    WHERE status = 'pending' AND queue = $1 AND run_at <= now()
    ORDER BY priority DESC, run_at, id
    LIMIT (SELECT n FROM room)
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {s}.jobs AS j
    SET status = 'running', attempts = j.attempts + 1, claims = j.claims + 1, locked_by = $3,
        locked_at = (SELECT now FROM room), lease_expires_at = (SELECT now FROM room) + j.lease
    WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING """
    + _CLAIMED
    + """
),
counted AS (
    INSERT INTO {s}.queue_claims AS c (queue, slot_start, slot_end, claims)
    SELECT $1, s.start, s.start + make_interval(secs => r.slot_s), n.claimed
    FROM room AS r
    CROSS JOIN LATERAL (
        SELECT to_timestamp(floor(extract(epoch FROM r.now) / r.slot_s) * r.slot_s) AS start
    ) AS s
    CROSS JOIN (SELECT count(*) AS claimed FROM claimed) AS n
    WHERE r.rate_limit IS NOT NULL AND n.claimed > 0
    ON CONFLICT (queue, slot_start) DO UPDATE
    SET claims = c.claims + EXCLUDED.claims, slot_end = greatest(c.slot_end, EXCLUDED.slot_end)
),
pruned AS (
    DELETE FROM {s}.queue_claims AS c
    USING room AS r
    WHERE c.queue = $1 AND c.slot_end <= r.now - coalesce(r.rate_period, interval '0')
)
SELECT c.*, r.rate_room FROM room AS r LEFT JOIN claimed AS c ON true
"""
)

# Upsert a queue's settings: $2/$4/$7 say which of max_running ($3), the rate ($5 claims per
# $6 seconds) and paused ($8) to set; the others keep their value. With $9, a queue that has
# neither settings nor live jobs is refused (a typo in a pause). Notifies the workers that
# limits changed (LIMITS_CHANGED: they read them again), then rings the queue's doorbell, so
# a resume (or a raised limit) is claimed at once.
SET_QUEUE = """
WITH changed AS (
    INSERT INTO {s}.queues AS q (name, max_running, rate_limit, rate_period, paused)
    SELECT $1, CASE WHEN $2 THEN $3::integer END, CASE WHEN $4 THEN $5::integer END,
           CASE WHEN $4 THEN make_interval(secs => $6::float8) END, $7 AND $8
    WHERE NOT $9
       OR EXISTS (SELECT FROM {s}.queues WHERE name = $1)
       OR EXISTS (SELECT FROM {s}.jobs WHERE queue = $1 AND status = 'pending')
       OR EXISTS (SELECT FROM {s}.jobs WHERE queue = $1 AND status = 'running')
    ON CONFLICT (name) DO UPDATE
    SET max_running = CASE WHEN $2 THEN EXCLUDED.max_running ELSE q.max_running END,
        rate_limit = CASE WHEN $4 THEN EXCLUDED.rate_limit ELSE q.rate_limit END,
        rate_period = CASE WHEN $4 THEN EXCLUDED.rate_period ELSE q.rate_period END,
        paused = CASE WHEN $7 THEN EXCLUDED.paused ELSE q.paused END,
        updated_at = now()
    RETURNING q.name
),
rang AS (
    SELECT pg_notify($10, ''), pg_notify($10, name) FROM changed
)
SELECT name FROM changed WHERE (SELECT count(*) FROM rang) >= 0
"""

# Every queue's settings, with the claims counted in its rate window now.
QUEUE_SETTINGS = """
SELECT q.name, q.max_running, q.rate_limit,
       extract(epoch FROM q.rate_period)::float8 AS rate_period, q.paused, q.updated_at,
       CASE WHEN q.rate_limit IS NOT NULL THEN (
           SELECT coalesce(sum(c.claims), 0)::integer FROM {s}.queue_claims AS c
           WHERE c.queue = q.name AND c.slot_end > clock_timestamp() - q.rate_period) END
           AS window_claims
FROM {s}.queues AS q
ORDER BY q.name
"""

# --- Finished jobs in the archive (issue 11) -------------------------------------------------
# Shaped as GET_JOB's rows, status 'succeeded'. The archive keeps no run_at, lease, error or
# unique_key: run_at and locked_at are when the successful attempt started.
_ARCHIVED_JOB = """
SELECT id, queue, task, args::text AS args, 'succeeded' AS status, priority, started_at AS run_at,
       attempts, max_attempts, NULL::float8 AS lease, worker AS locked_by,
       started_at AS locked_at, NULL::timestamptz AS lease_expires_at, NULL::text AS last_error,
       NULL::text AS unique_key, created_at, finished_at, worker AS last_worker
FROM {s}.archive
"""

GET_ARCHIVED_JOB = _ARCHIVED_JOB + "WHERE id = $1\n"

# $1 task, $2 queue (NULL: any), $3 limit.
LIST_ARCHIVED_JOBS = (
    _ARCHIVED_JOB
    + """WHERE ($1::text IS NULL OR task = $1)
  AND ($2::text IS NULL OR queue = $2)
ORDER BY id
LIMIT $3
"""
)

# Whether any worker keeps finished jobs: an empty archive means they are being deleted.
ARCHIVE_IN_USE = "SELECT EXISTS (SELECT FROM {s}.archive)"


# --- job control: cancel, progress, results (issue 12) ---

# Pending (ready or scheduled) jobs become cancelled at once; running ones get a cancel request
# that their worker acts on (a NOTIFY on the control channel now, its cancel watch within a
# heartbeat interval otherwise). One UPDATE for both, so a job claimed while this statement
# waits for its row lock is re-checked as running and still gets its request.
# $1 ids, $2 control channel, $3 results channel (waiters of a job cancelled while pending).
# A row that was live in this statement's snapshot but that the UPDATE did not change ended
# (or changed hands) concurrently: 'raced', and the caller asks again with a fresh snapshot.
CANCEL_JOBS = """
WITH wanted AS (
    SELECT DISTINCT id FROM unnest($1::bigint[]) AS w(id)
),
locked AS (  -- in id order, like the fenced writes: two statements never deadlock
    SELECT j.id FROM {s}.jobs AS j
    WHERE j.id IN (SELECT id FROM wanted) AND j.status IN ('pending', 'running')
    ORDER BY j.id
    FOR UPDATE OF j
),
changed AS (
    UPDATE {s}.jobs AS j
    SET status = CASE WHEN j.status = 'pending' THEN 'cancelled' ELSE j.status END,
        run_at = CASE WHEN j.status = 'pending' THEN now() ELSE j.run_at END,
        cancel_requested_at = coalesce(j.cancel_requested_at, now())
    FROM locked
    WHERE j.id = locked.id AND j.status IN ('pending', 'running')
    RETURNING j.id, j.status
),
rang AS (
    SELECT pg_notify(CASE WHEN status = 'running' THEN $2 ELSE $3 END, id::text) FROM changed
)
SELECT w.id,
       CASE WHEN c.status = 'cancelled' THEN 'cancelled'
            WHEN c.status = 'running' THEN 'cancelling'
            WHEN j.status IN ('dead', 'cancelled') THEN j.status
            WHEN j.status IS NOT NULL THEN 'raced'
            WHEN EXISTS (SELECT FROM {s}.results AS r WHERE r.id = w.id)
              OR EXISTS (SELECT FROM {s}.archive AS a WHERE a.id = w.id) THEN 'finished'
            ELSE 'missing'
       END AS state
FROM wanted AS w
LEFT JOIN changed AS c ON c.id = w.id
LEFT JOIN {s}.jobs AS j ON j.id = w.id
WHERE (SELECT count(*) FROM rang) >= 0
ORDER BY w.id
"""

# Our running jobs that someone asked to cancel: what the cancel watch delivers when the
# control channel's notification was missed. $1 ids, $2 claim numbers, $3 worker id. A read:
# no row lock, so it never waits on (or for) the fenced writes.
CANCEL_REQUESTED = """
SELECT j.id FROM {s}.jobs AS j
JOIN unnest($1::bigint[], $2::integer[]) AS f(id, claim) ON j.id = f.id
WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
  AND j.cancel_requested_at IS NOT NULL
"""

# The worker records a cancelled run, fenced like every other outcome; $4 says per job whether
# its task stores results (someone may await it: ring the results channel $5).
CANCEL_RUNNING = """
WITH mine AS (
    SELECT j.id, f.awaited FROM {s}.jobs AS j
    JOIN unnest($1::bigint[], $2::integer[], $4::boolean[]) AS f(id, claim, awaited)
         ON j.id = f.id
    WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
),
changed AS (
    UPDATE {s}.jobs AS j
    SET status = 'cancelled', run_at = now(),  -- when it ended: the pruner's clock
        cancel_requested_at = coalesce(j.cancel_requested_at, now()),
        last_worker = j.locked_by, locked_by = NULL, locked_at = NULL, lease_expires_at = NULL
    FROM mine AS m
    WHERE j.id = m.id
    RETURNING j.id, m.awaited
),
rang AS (
    SELECT pg_notify($5, id::text) FROM changed WHERE awaited
)
SELECT id FROM changed WHERE (SELECT count(*) FROM rang) >= 0
"""

# Ring the results channel for jobs that ended in a state written by another statement (dead).
RING_RESULTS = """
SELECT count(pg_notify($1, id::text)) FROM unnest($2::bigint[]) AS r(id)
"""

# Completion of jobs whose task stores its result: out of the hot table into results (and the
# archive too when the worker keeps completed jobs), and a NOTIFY per job for its waiters.
# $4 results (JSON text), $5 their TTLs in seconds, $6 archive too, $7 the results channel.
COMPLETE_RESULT = """
WITH mine AS (
    SELECT j.id, f.result, f.ttl FROM {s}.jobs AS j
    JOIN unnest($1::bigint[], $2::integer[], $4::text[], $5::float8[])
         AS f(id, claim, result, ttl) ON j.id = f.id
    WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
),
done AS (
    DELETE FROM {s}.jobs AS j
    USING mine AS m
    WHERE j.id = m.id
    RETURNING j.*, m.result, m.ttl
),
kept AS (
    INSERT INTO {s}.results (id, queue, task, args, priority, attempts, max_attempts, worker,
                             progress, progress_note, created_at, started_at, finished_at,
                             expires_at, result)
    SELECT id, queue, task, args, priority, attempts, max_attempts, locked_by, progress,
           progress_note, created_at, locked_at, clock_timestamp(),
           clock_timestamp() + make_interval(secs => ttl), result::jsonb
    FROM done
    RETURNING id
),
archived AS (
    INSERT INTO {s}.archive (id, queue, task, args, priority, attempts, max_attempts, worker,
                             created_at, started_at, finished_at)
    SELECT id, queue, task, args, priority, attempts, max_attempts, locked_by,
           created_at, locked_at, clock_timestamp()
    FROM done WHERE $6::boolean
    RETURNING 1
),
rang AS (
    SELECT pg_notify($7, id::text) FROM kept
)
SELECT id FROM kept
WHERE (SELECT count(*) FROM rang) >= 0 AND (SELECT count(*) FROM archived) >= 0
"""

# A task reports how far it is; fenced, so a run that lost its claim changes nothing.
SET_PROGRESS = """
UPDATE {s}.jobs AS j
SET progress = $4, progress_note = $5
WHERE j.id = $1 AND j.claims = $2 AND j.locked_by = $3 AND j.status = 'running'
RETURNING j.id
"""

# What a waiter needs: the live or kept job's state, or its stored result.
RESULT_STATE = """
SELECT status, last_error, NULL::text AS result, false AS expired FROM {s}.jobs WHERE id = $1
UNION ALL
SELECT 'succeeded', NULL, result::text, expires_at <= now() FROM {s}.results WHERE id = $1
LIMIT 1
"""

# Retention: results past their TTL, in bounded SKIP LOCKED batches like PRUNE_ENDED.
PRUNE_RESULTS = """
WITH deleted AS (
    DELETE FROM {s}.results
    WHERE id IN (
        SELECT id FROM {s}.results
        WHERE expires_at < now()
        ORDER BY expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
"""

# Succeeded jobs that kept a result, shaped as GET_JOB's rows: for `jobs list --status
# succeeded` beside the archive's. $1 task, $2 queue (NULL: any), $3 limit.
LIST_RESULT_JOBS = """
SELECT id, queue, task, args::text AS args, 'succeeded' AS status, priority, started_at AS run_at,
       attempts, max_attempts, NULL::float8 AS lease, worker AS locked_by,
       started_at AS locked_at, NULL::timestamptz AS lease_expires_at, NULL::text AS last_error,
       NULL::text AS unique_key, created_at, finished_at, progress, progress_note,
       result::text AS result, worker AS last_worker
FROM {s}.results
WHERE ($1::text IS NULL OR task = $1)
  AND ($2::text IS NULL OR queue = $2)
  AND expires_at > now()
ORDER BY id
LIMIT $3
"""

# --- testing (aioq.testing) -------------------------------------------------------------------

# The queues that hold a job ready to run now: the test drain serves exactly these.
READY_QUEUES = """
SELECT DISTINCT queue FROM {s}.jobs WHERE status = 'pending' AND run_at <= now() ORDER BY queue
"""

# A task's waiting jobs (pending, due or scheduled), oldest first, for assertions in tests.
WAITING_JOBS = """
SELECT id, queue, args::text AS args, priority, run_at, attempts, max_attempts
FROM {s}.jobs WHERE status = 'pending' AND task = $1
ORDER BY run_at, id
"""

# --- The conditional doorbell (invariant 15) -------------------------------------------------
# A worker about to sleep holds a shared session advisory lock per served queue on its LISTEN
# connection, keyed (the jobs table's oid, hashtext(queue)); the jobs_doorbell trigger in
# schema.sql rings a queue only when its exclusive try of that lock fails. The session holds
# the lock, so a worker that dies (its connection closes) stops the ringing with it. Each
# inserting transaction holds (~oid, hashtext(queue)) shared until it ends: an exclusive try
# of that key that fails means an insert that may not have rung is still in flight.

# True if any queue's in-flight key is taken (an exclusive try fails), over rows with q.
_IN_FLIGHT = """
SELECT coalesce(bool_or(NOT (
    pg_try_advisory_lock(~'{s}.jobs'::regclass::oid::int, hashtext(q))
    AND pg_advisory_unlock(~'{s}.jobs'::regclass::oid::int, hashtext(q))
)), false)
"""

# $1: the queues. Takes each queue's doorbell lock, then (OFFSET 0 keeps the order: the outer
# test runs on each row the subquery made) tests its in-flight key; true if any was taken.
ARM_DOORBELL = (
    _IN_FLIGHT
    + """FROM (
    SELECT q, pg_advisory_lock_shared('{s}.jobs'::regclass::oid::int, hashtext(q))
    FROM unnest($1::text[]) AS q OFFSET 0
) AS armed
"""
)

# The in-flight test alone, for a worker that holds its doorbell locks already.
INSERTS_IN_FLIGHT = _IN_FLIGHT + "FROM unnest($1::text[]) AS q\n"

DISARM_DOORBELL = """
SELECT pg_advisory_unlock_shared('{s}.jobs'::regclass::oid::int, hashtext(q))
FROM unnest($1::text[]) AS q
"""
