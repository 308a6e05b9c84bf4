"""How a job enters the table (defer) and leaves ``pending`` (the claim): docs/architecture.md,
"Transactional defer" and "The claim".

Every insert rings its queue's doorbell itself when its job is claimable now and a worker is on
duty (``@rang``; docs/architecture.md, "The doorbell"): no trigger runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.job import Claim
from aioq.sql import Named, Statement, integer

__all__ = (
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
    "ClaimJobs",
    "ClaimQueues",
    "InsertJob",
    "InsertJobs",
    "InsertKeyedJob",
    "InsertKeyedJobs",
    "InsertUniqueJob",
    "InsertUniqueJobFor",
)

TABLE_DEFAULTS = (0, 5, 30.0)
"""The column defaults of jobs.priority, max_attempts and lease (seconds) in schema.sql."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertJob:
    """One job: its queue, task and arguments (JSON text), and every option."""

    queue: str
    task: str
    args: str
    priority: int
    run_at: datetime | None  # None: now + delay
    delay: float  # seconds
    max_attempts: int
    lease: float  # seconds
    traceparent: str | None


INSERT_JOB = Named(
    InsertJob,
    """
WITH ready_queues(queue) AS (SELECT :queue::text WHERE @run_at <= now()),
@rang
INSERT INTO @schema.jobs (queue, task, args, priority, run_at, max_attempts, lease, traceparent)
SELECT :queue, :task, :args::text::jsonb, :priority, @run_at, :max_attempts,
       make_interval(secs => :lease::float8), :traceparent
WHERE (SELECT count(*) FROM rang) >= 0
RETURNING id
""",
    integer,
)

# The common case (every option at the table's default, TABLE_DEFAULTS): three parameters to
# encode, send and bind, the rest from the column defaults in schema.sql. The defer path picks
# it (JobOptions.at_defaults); a test keeps the two in step.
INSERT_DEFAULT_JOB = Statement(
    """
WITH ready_queues(queue) AS (SELECT :queue::text),
@rang
INSERT INTO @schema.jobs (queue, task, args)
SELECT :queue, :task, :args::text::jsonb WHERE (SELECT count(*) FROM rang) >= 0
RETURNING id
""",
    integer,
    ("queue", "task", "args"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertUniqueJob(InsertJob):
    """One job with a unique key (unique among live jobs)."""

    unique_key: str


# ON CONFLICT waits for a concurrent insert of the same key to commit; if the existing row was
# committed after this statement's snapshot, no id comes back and the caller asks again.
INSERT_UNIQUE_JOB = Named(
    InsertUniqueJob,
    """
WITH inserted AS (
    INSERT INTO @schema.jobs
        (queue, task, args, priority, run_at, max_attempts, lease, traceparent, unique_key)
    VALUES (:queue, :task, :args::text::jsonb, :priority, @run_at, :max_attempts,
            make_interval(secs => :lease::float8), :traceparent, :unique_key)
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND status IN ('pending', 'running')
    DO NOTHING
    RETURNING id, run_at
),
ready_queues(queue) AS (SELECT :queue::text FROM inserted WHERE run_at <= now()),
@rang
SELECT id FROM inserted WHERE (SELECT count(*) FROM rang) >= 0
UNION ALL
SELECT id FROM @schema.jobs
WHERE unique_key = :unique_key AND status IN ('pending', 'running')
  AND NOT EXISTS (SELECT FROM inserted)
LIMIT 1
""",
    integer,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertJobs:
    """Many jobs of one task and options: the arguments of each (JSON text), in order."""

    queue: str
    task: str
    priority: int
    run_at: datetime | None
    delay: float
    max_attempts: int
    lease: float
    args: list[str]
    traceparent: str | None


# The ids come back in the order of :args.
INSERT_JOBS = Named(
    InsertJobs,
    """
WITH ready_queues(queue) AS (
    SELECT :queue::text WHERE @run_at <= now() AND cardinality(:args::text[]) > 0
),
@rang
INSERT INTO @schema.jobs (queue, task, args, priority, run_at, max_attempts, lease, traceparent)
SELECT :queue, :task, a.args::jsonb, :priority, @run_at, :max_attempts,
       make_interval(secs => :lease::float8), :traceparent
FROM unnest(:args::text[]) WITH ORDINALITY AS a(args, n)
WHERE (SELECT count(*) FROM rang) >= 0
ORDER BY a.n
RETURNING id
""",
    integer,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertKeyedJob(InsertJob):
    """One job with a concurrency key (docs/architecture.md, "Per-key concurrency"); jobs
    without one take INSERT_JOB, unchanged."""

    concurrency_key: str


INSERT_KEYED_JOB = Named(
    InsertKeyedJob,
    """
WITH ready_queues(queue) AS (SELECT :queue::text WHERE @run_at <= now()),
@rang
INSERT INTO @schema.jobs
    (queue, task, args, priority, run_at, max_attempts, lease, traceparent, concurrency_key)
SELECT :queue, :task, :args::text::jsonb, :priority, @run_at, :max_attempts,
       make_interval(secs => :lease::float8), :traceparent, :concurrency_key
WHERE (SELECT count(*) FROM rang) >= 0
RETURNING id
""",
    integer,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertKeyedJobs(InsertJobs):
    """Many jobs, each with its concurrency key, in the order of ``args``."""

    concurrency_keys: list[str | None]


INSERT_KEYED_JOBS = Named(
    InsertKeyedJobs,
    """
WITH ready_queues(queue) AS (
    SELECT :queue::text WHERE @run_at <= now() AND cardinality(:args::text[]) > 0
),
@rang
INSERT INTO @schema.jobs
    (queue, task, args, priority, run_at, max_attempts, lease, traceparent, concurrency_key)
SELECT :queue, :task, a.args::jsonb, :priority, @run_at, :max_attempts,
       make_interval(secs => :lease::float8), :traceparent, a.key
FROM unnest(:args::text[], :concurrency_keys::text[]) WITH ORDINALITY AS a(args, key, n)
WHERE (SELECT count(*) FROM rang) >= 0
ORDER BY a.n
RETURNING id
""",
    integer,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertUniqueJobFor(InsertUniqueJob):
    """A unique job with a window, a replace, or a concurrency key."""

    unique_for: float | None  # the window in seconds (None: none)
    replace: bool  # replace a pending live job's arguments and run time
    concurrency_key: str | None


# A unique job with a window, a replace, or a concurrency key (docs/architecture.md, "Unique
# jobs"):
# - a live job holds the key: its id (with :replace, its arguments and run time replaced while
#   it is pending: a claim that took it first wins, the replace then changes nothing);
# - with a window (:unique_for): the uniques row is the gate. Its primary key makes a
#   concurrent defer of the key wait for this one's commit; ON CONFLICT then sees the committed
#   row even if this statement's snapshot does not, and takes it over only if it has expired.
#   The job gets its id in the gate (the jobs' identity sequence), so one statement writes both
#   rows;
# - a conflict this statement's snapshot cannot see returns no id: the caller asks again.
# Inserted or replaced, a job claimable now rings its queue.
INSERT_UNIQUE_JOB_FOR = Named(
    InsertUniqueJobFor,
    """
WITH live AS (
    SELECT id FROM @schema.jobs
    WHERE unique_key = :unique_key AND status IN ('pending', 'running')
),
replaced AS (
    UPDATE @schema.jobs AS j
    SET args = :args::text::jsonb, run_at = @run_at
    FROM live
    WHERE :replace AND j.id = live.id AND j.status = 'pending'
    RETURNING j.id, j.run_at
),
gate AS (
    INSERT INTO @schema.uniques AS u (key, job_id, expires_at)
    SELECT :unique_key, nextval(pg_get_serial_sequence('@schema.jobs', 'id')),
           now() + make_interval(secs => :unique_for::float8)
    WHERE :unique_for::float8 IS NOT NULL AND NOT EXISTS (SELECT FROM live)
    ON CONFLICT (key) DO UPDATE SET job_id = EXCLUDED.job_id, expires_at = EXCLUDED.expires_at
    WHERE u.expires_at <= now()
    RETURNING job_id
),
inserted AS (
    INSERT INTO @schema.jobs (id, queue, task, args, priority, run_at, max_attempts, lease,
                              traceparent, unique_key, concurrency_key)
    OVERRIDING SYSTEM VALUE
    SELECT g.id, :queue, :task, :args::text::jsonb, :priority, @run_at, :max_attempts,
           make_interval(secs => :lease::float8), :traceparent, :unique_key, :concurrency_key
    FROM (SELECT job_id AS id FROM gate
          UNION ALL
          SELECT nextval(pg_get_serial_sequence('@schema.jobs', 'id'))
          WHERE :unique_for::float8 IS NULL AND NOT EXISTS (SELECT FROM live)) AS g
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND status IN ('pending', 'running')
    DO NOTHING
    RETURNING id, run_at
),
ready_queues(queue) AS (
    SELECT :queue::text
    WHERE EXISTS (SELECT FROM inserted WHERE run_at <= now())
       OR EXISTS (SELECT FROM replaced WHERE run_at <= now())
),
@rang
SELECT id FROM inserted WHERE (SELECT count(*) FROM rang) >= 0
UNION ALL
SELECT id FROM live WHERE (SELECT count(*) FROM rang) >= 0
UNION ALL
SELECT job_id FROM @schema.uniques
WHERE key = :unique_key AND expires_at > now() AND :unique_for::float8 IS NOT NULL
  AND NOT EXISTS (SELECT FROM live) AND NOT EXISTS (SELECT FROM gate)
LIMIT 1
""",
    integer,
)

# The claim, of the rows a `picked` CTE chose. `id = ANY(ARRAY(...))` rather than a join with
# picked: the prepared statement's generic plan guesses LIMIT :limit at a tenth of the ready
# rows, and with a join it then hashes a sequential scan of the whole table on every claim
# (6 ms at a 30 000-job backlog, against 0.1 ms). The array is looked up in the primary key
# whatever the estimate.


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimJobs:
    """A claim of up to ``limit`` ready jobs of ``queue`` for ``worker``; ``unknown`` and
    ``grace``: the tasks this worker found it does not know, and how long their jobs may wait
    for a worker that knows them (@known; docs/architecture.md, "Unknown tasks")."""

    queue: str
    limit: int
    worker: str
    unknown: list[str]
    grace: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimQueues:
    """A claim of up to ``limit`` ready jobs of any of ``queues`` (as :class:`ClaimJobs`)."""

    queues: list[str]
    limit: int
    worker: str
    unknown: list[str]
    grace: float


# One queue: the index's leading column is an equality, so the scan reads in claim order
# (schema.sql's jobs_claim_idx matches @ready and @claim_order exactly). @known only filters
# the rows the scan reads.
CLAIM_ONE_QUEUE = Named(
    ClaimJobs,
    """
WITH picked AS (
    SELECT id FROM @schema.jobs
    WHERE queue = :queue AND @ready AND @known
    ORDER BY @claim_order
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
UPDATE @schema.jobs AS j
SET @claim,
    locked_at = now(), lease_expires_at = now() + j.lease
WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING @claimed_columns
""",
    Claim.from_row,
)

# Many queues: the same ordered index scan per queue (each reads at most :limit rows), then a
# sort of those few. `queue = ANY(...)` instead would sort every ready row of the queues. Rows
# locked here but cut by the outer LIMIT stay pending; their locks end with the statement.
CLAIM_QUEUES = Named(
    ClaimQueues,
    """
WITH picked AS (
    SELECT p.id FROM unnest(:queues::text[]) AS q(queue)
    CROSS JOIN LATERAL (
        SELECT id, priority, run_at FROM @schema.jobs
        WHERE queue = q.queue AND @ready AND @known
        ORDER BY @claim_order
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ) AS p
    ORDER BY @claim_order
    LIMIT :limit
)
UPDATE @schema.jobs AS j
SET @claim,
    locked_at = now(), lease_expires_at = now() + j.lease
WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING @claimed_columns
""",
    Claim.from_row,
)
