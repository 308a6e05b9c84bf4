"""How a job enters the table (defer) and leaves ``pending`` (the claim): docs/architecture.md,
"Transactional defer" and "The claim"."""

from __future__ import annotations

from aioq.job import Claim
from aioq.sql import Statement, integer
from aioq.sql.doorbell import ring

__all__ = (
    "CLAIMED",
    "CLAIM_ONE_QUEUE",
    "CLAIM_QUEUES",
    "INSERT_DEFAULT_JOB",
    "INSERT_JOB",
    "INSERT_JOBS",
    "INSERT_KEYED_JOB",
    "INSERT_KEYED_JOBS",
    "INSERT_UNIQUE_JOB",
    "INSERT_UNIQUE_JOB_FOR",
    "TABLE_DEFAULTS",
    "claim_set",
)

TABLE_DEFAULTS = (0, 5, 30.0)
"""The column defaults of jobs.priority, max_attempts and lease (seconds) in schema.sql."""

# Every insert rings its queue's doorbell itself when its job is claimable now and a worker
# is on duty (the `rang` CTE, aioq.sql.doorbell.ring; docs/architecture.md, "The doorbell"): no
# trigger runs. The run time of the jobs of $5/$6 (or $4/$5 in the many-job inserts):
RUN_AT = "coalesce($5::timestamptz, now() + make_interval(secs => $6::float8))"
READS_RANG = "(SELECT count(*) FROM rang) >= 0"

# $1 queue, $2 task, $3 args (JSON text), $4 priority, $5 run_at (NULL: now + $6 seconds),
# $7 max_attempts, $8 lease seconds, $9 traceparent.
INSERT_JOB = Statement(
    f"""
WITH {ring(f"SELECT $1::text WHERE {RUN_AT} <= now()")}
INSERT INTO {{s}}.jobs (queue, task, args, priority, run_at, max_attempts, lease, traceparent)
SELECT $1, $2, $3::text::jsonb, $4, {RUN_AT}, $7, make_interval(secs => $8::float8), $9
WHERE {READS_RANG}
RETURNING id
""",
    integer,
)

# The common case (every option at the table's default, TABLE_DEFAULTS): three parameters to
# encode, send and bind, the rest from the column defaults in schema.sql. TaskCall.defer picks
# it (JobOptions.at_defaults); a test keeps the two in step.
INSERT_DEFAULT_JOB = Statement(
    f"""
WITH {ring("SELECT $1::text")}
INSERT INTO {{s}}.jobs (queue, task, args)
SELECT $1, $2, $3::text::jsonb WHERE {READS_RANG}
RETURNING id
""",
    integer,
)

# INSERT_JOB's parameters and $10 the unique key. ON CONFLICT waits for a concurrent insert of
# the same key to commit; if the existing row was committed after this statement's snapshot,
# no id comes back and the caller asks again.
INSERT_UNIQUE_JOB = Statement(
    f"""
WITH inserted AS (
    INSERT INTO {{s}}.jobs
        (queue, task, args, priority, run_at, max_attempts, lease, traceparent, unique_key)
    VALUES ($1, $2, $3::text::jsonb, $4, {RUN_AT}, $7, make_interval(secs => $8::float8), $9,
            $10)
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND status IN ('pending', 'running')
    DO NOTHING
    RETURNING id, run_at
),
{ring("SELECT $1::text FROM inserted WHERE run_at <= now()")}
SELECT id FROM inserted WHERE {READS_RANG}
UNION ALL
SELECT id FROM {{s}}.jobs
WHERE unique_key = $10 AND status IN ('pending', 'running') AND NOT EXISTS (SELECT FROM inserted)
LIMIT 1
""",
    integer,
)

# Many jobs of one task: INSERT_JOB's options, $8 the arguments of each job (JSON text), in
# order; the ids come back in the same order.
MANY_RUN_AT = "coalesce($4::timestamptz, now() + make_interval(secs => $5::float8))"
INSERT_JOBS = Statement(
    f"""
WITH {ring(f"SELECT $1::text WHERE {MANY_RUN_AT} <= now() AND cardinality($8::text[]) > 0")}
INSERT INTO {{s}}.jobs (queue, task, args, priority, run_at, max_attempts, lease, traceparent)
SELECT $1, $2, a.args::jsonb, $3, {MANY_RUN_AT}, $6, make_interval(secs => $7::float8), $9
FROM unnest($8::text[]) WITH ORDINALITY AS a(args, n)
WHERE {READS_RANG}
ORDER BY a.n
RETURNING id
""",
    integer,
)

# INSERT_JOB's parameters and $10 the job's concurrency key (docs/architecture.md, "Per-key
# concurrency"); jobs without a key take INSERT_JOB, unchanged.
INSERT_KEYED_JOB = Statement(
    f"""
WITH {ring(f"SELECT $1::text WHERE {RUN_AT} <= now()")}
INSERT INTO {{s}}.jobs
    (queue, task, args, priority, run_at, max_attempts, lease, traceparent, concurrency_key)
SELECT $1, $2, $3::text::jsonb, $4, {RUN_AT}, $7, make_interval(secs => $8::float8), $9, $10
WHERE {READS_RANG}
RETURNING id
""",
    integer,
)

# INSERT_JOBS's parameters and $10 each job's concurrency key, in the order of $8.
INSERT_KEYED_JOBS = Statement(
    f"""
WITH {ring(f"SELECT $1::text WHERE {MANY_RUN_AT} <= now() AND cardinality($8::text[]) > 0")}
INSERT INTO {{s}}.jobs
    (queue, task, args, priority, run_at, max_attempts, lease, traceparent, concurrency_key)
SELECT $1, $2, a.args::jsonb, $3, {MANY_RUN_AT}, $6, make_interval(secs => $7::float8), $9,
       a.key
FROM unnest($8::text[], $10::text[]) WITH ORDINALITY AS a(args, key, n)
WHERE {READS_RANG}
ORDER BY a.n
RETURNING id
""",
    integer,
)

# A unique job with a window, a replace, or a concurrency key (docs/architecture.md, "Unique
# jobs"): INSERT_UNIQUE_JOB's parameters, $11 the window in seconds (NULL: none), $12 whether
# to replace a pending live job's arguments and run time, $13 the concurrency key.
# - a live job holds the key: its id (with $12, its arguments and run time replaced while it
#   is pending: a claim that took it first wins, the replace then changes nothing);
# - with a window: the uniques row is the gate. Its primary key makes a concurrent defer of
#   the key wait for this one's commit; ON CONFLICT then sees the committed row even if this
#   statement's snapshot does not, and takes it over only if it has expired. The job gets its
#   id in the gate (the jobs' identity sequence), so one statement writes both rows;
# - a conflict this statement's snapshot cannot see returns no id: the caller asks again.
# Inserted or replaced, a job claimable now rings its queue.
_INSERTED_OR_REPLACED = """SELECT $1::text
    WHERE EXISTS (SELECT FROM inserted WHERE run_at <= now())
       OR EXISTS (SELECT FROM replaced WHERE run_at <= now())"""
INSERT_UNIQUE_JOB_FOR = Statement(
    f"""
WITH live AS (
    SELECT id FROM {{s}}.jobs
    WHERE unique_key = $10 AND status IN ('pending', 'running')
),
replaced AS (
    UPDATE {{s}}.jobs AS j
    SET args = $3::text::jsonb,
        run_at = coalesce($5::timestamptz, now() + make_interval(secs => $6::float8))
    FROM live
    WHERE $12 AND j.id = live.id AND j.status = 'pending'
    RETURNING j.id, j.run_at
),
gate AS (
    INSERT INTO {{s}}.uniques AS u (key, job_id, expires_at)
    SELECT $10, nextval(pg_get_serial_sequence('{{s}}.jobs', 'id')),
           now() + make_interval(secs => $11::float8)
    WHERE $11::float8 IS NOT NULL AND NOT EXISTS (SELECT FROM live)
    ON CONFLICT (key) DO UPDATE SET job_id = EXCLUDED.job_id, expires_at = EXCLUDED.expires_at
    WHERE u.expires_at <= now()
    RETURNING job_id
),
inserted AS (
    INSERT INTO {{s}}.jobs (id, queue, task, args, priority, run_at, max_attempts, lease,
                          traceparent, unique_key, concurrency_key)
    OVERRIDING SYSTEM VALUE
    SELECT g.id, $1, $2, $3::text::jsonb, $4,
           coalesce($5::timestamptz, now() + make_interval(secs => $6::float8)),
           $7, make_interval(secs => $8::float8), $9, $10, $13
    FROM (SELECT job_id AS id FROM gate
          UNION ALL
          SELECT nextval(pg_get_serial_sequence('{{s}}.jobs', 'id'))
          WHERE $11::float8 IS NULL AND NOT EXISTS (SELECT FROM live)) AS g
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND status IN ('pending', 'running')
    DO NOTHING
    RETURNING id, run_at
),
{ring(_INSERTED_OR_REPLACED)}
SELECT id FROM inserted WHERE {READS_RANG}
UNION ALL
SELECT id FROM live WHERE {READS_RANG}
UNION ALL
SELECT job_id FROM {{s}}.uniques
WHERE key = $10 AND expires_at > now() AND $11::float8 IS NOT NULL
  AND NOT EXISTS (SELECT FROM live) AND NOT EXISTS (SELECT FROM gate)
LIMIT 1
""",
    integer,
)

# What a claim returns, as Claim.from_row reads it (the limited claim returns the same).
CLAIMED = """j.id, j.claims, j.queue, j.task, j.args::text AS args, j.priority, j.attempts,
          j.max_attempts, j.snoozes, extract(epoch FROM j.lease)::float8 AS lease,
          extract(epoch FROM j.locked_at - j.run_at)::float8 AS waited, j.traceparent,
          j.scheduled_at, j.workflow_id"""


def claim_set(now: str = "now()") -> str:
    """The claim itself, of the rows a ``picked`` CTE chose: the claim counter moves (the
    claim's identity, docs/architecture.md "The fence") and the lease starts at ``now``."""
    # `id = ANY(ARRAY(...))` rather than a join with picked: the prepared statement's generic
    # plan guesses LIMIT $2 at a tenth of the ready rows, and with a join it then hashes a
    # sequential scan of the whole table on every claim (6 ms at a 30 000-job backlog,
    # against 0.1 ms). The array is looked up in the primary key whatever the estimate.
    return f"""
UPDATE {{s}}.jobs AS j
SET status = 'running', attempts = j.attempts + 1, claims = j.claims + 1, locked_by = $3,
    locked_at = {now}, lease_expires_at = {now} + j.lease
WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING {CLAIMED}
"""


# $1 the queue, $2 how many, $3 the worker. One queue: the index's leading column is an
# equality, so the scan reads in claim order (schema.sql's jobs_claim_idx matches it exactly).
CLAIM_ONE_QUEUE = Statement(
    """
WITH picked AS (
    SELECT id FROM {s}.jobs
    WHERE status = 'pending' AND queue = $1 AND run_at <= now()
    ORDER BY priority DESC, run_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)"""
    + claim_set(),
    Claim.from_row,
)

# $1 the queues. The same ordered index scan per queue (each reads at most $2 rows), then a
# sort of those few. `queue = ANY(...)` instead would sort every ready row of the queues.
# Rows locked here but cut by the outer LIMIT stay pending; their locks end with the statement.
CLAIM_QUEUES = Statement(
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
    + claim_set(),
    Claim.from_row,
)
