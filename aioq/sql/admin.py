"""Inspecting and steering jobs from outside a worker: the admin functions, the CLI, the tests.

docs/architecture.md, "Tables" says where a job is in each state: pending, running, dead and
cancelled jobs in ``jobs``; succeeded ones in ``results`` (tasks with a result_ttl) or the
``archive`` (workers that keep completed jobs), or nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.job import Job
from aioq.sql import Statement, boolean, columns, integer, nothing, text

__all__ = (
    "ARCHIVE_IN_USE",
    "ARCHIVE_STATS",
    "BLOCKED_STEPS",
    "DELETE_JOBS",
    "GET_ARCHIVED_JOB",
    "GET_JOB",
    "LIST_ARCHIVED_JOBS",
    "LIST_JOBS",
    "LIST_RESULT_JOBS",
    "PENDING_JOBS",
    "PENDING_TASKS",
    "PING",
    "QUEUE_STATS",
    "READY_QUEUES",
    "RELEASE_SAVEPOINT",
    "REPLAY",
    "ROLLBACK_TO_SAVEPOINT",
    "SAVEPOINT",
    "TABLE_STATS",
    "UNKNOWN_TASKS",
    "BlockedStep",
    "PendingJob",
    "QueueCompleted",
    "QueueCounts",
    "Replayed",
    "TableFigures",
    "TaskQueue",
    "UnknownTaskJobs",
)

# A statement that does nothing: a liveness probe, or what makes a driver begin its transaction.
PING = Statement("SELECT 1", nothing)

# A job that succeeded and stored a result has left the jobs table for results.
GET_JOB = Statement(
    """
SELECT @job_columns, NULL::timestamptz AS finished_at
FROM @schema.jobs WHERE id = :id
UNION ALL
SELECT id, queue, task, args::text, 'succeeded', priority, started_at, attempts, max_attempts,
       NULL, worker, started_at, NULL, NULL, NULL, created_at, NULL, progress, progress_note,
       result::text, worker, NULL, NULL, finished_at
FROM @schema.results WHERE id = :id
LIMIT 1
""",
    Job.from_row,
    ("id",),
)

# A status, task and queue (NULL: any), at most :limit jobs.
LIST_JOBS = Statement(
    """
SELECT @job_columns
FROM @schema.jobs
WHERE (:status::text IS NULL OR status = :status)
  AND (:task::text IS NULL OR task = :task)
  AND (:queue::text IS NULL OR queue = :queue)
ORDER BY id
LIMIT :limit
""",
    Job.from_row,
    ("status", "task", "queue", "limit"),
)

GET_ARCHIVED_JOB = Statement(
    """
@archived_job
WHERE id = :id
""",
    Job.from_row,
    ("id",),
)

# A task and queue (NULL: any), at most :limit jobs.
LIST_ARCHIVED_JOBS = Statement(
    """
@archived_job
WHERE (:task::text IS NULL OR task = :task)
  AND (:queue::text IS NULL OR queue = :queue)
ORDER BY id
LIMIT :limit
""",
    Job.from_row,
    ("task", "queue", "limit"),
)

# Whether any worker keeps finished jobs: an empty archive means they are being deleted.
ARCHIVE_IN_USE = Statement("SELECT EXISTS (SELECT FROM @schema.archive)", boolean)

# Succeeded jobs that kept a result, shaped as GET_JOB's rows: for `jobs list --status
# succeeded` beside the archive's. A task and queue (NULL: any), at most :limit jobs.
LIST_RESULT_JOBS = Statement(
    """
SELECT id, queue, task, args::text AS args, 'succeeded' AS status, priority, started_at AS run_at,
       attempts, max_attempts, NULL::float8 AS lease, worker AS locked_by,
       started_at AS locked_at, NULL::timestamptz AS lease_expires_at, NULL::text AS last_error,
       NULL::text AS unique_key, created_at, finished_at, progress, progress_note,
       result::text AS result, worker AS last_worker
FROM @schema.results
WHERE (:task::text IS NULL OR task = :task)
  AND (:queue::text IS NULL OR queue = :queue)
  AND expires_at > now()
ORDER BY id
LIMIT :limit
""",
    Job.from_row,
    ("task", "queue", "limit"),
)


@dataclass(frozen=True, slots=True)
class Replayed:
    """A dead job a replay matched: whether it was made pending again, and if not, why."""

    id: int
    unique_key: str | None
    replayed: bool
    live_id: int | None  # the live job holding its unique_key
    newest: int  # the dead job of its unique_key that was chosen
    revived: list[int]  # the workflow steps it cancelled that wait again, by job id
    revived_names: list[str]  # and their step names


# Dead jobs back to pending with fresh attempts (replay): :ids, :task, :queue (NULL: any).
# unique_key is unique among live jobs, so of the dead jobs sharing a key only the newest comes
# back, and none while a live job holds the key; every matching dead job is returned with what
# happened to it, so the caller can say why one was left. `newest` is a window over `locked`
# because FOR UPDATE and window functions cannot share a SELECT. A replayed workflow step that
# still waits for its dependencies (the BEFORE trigger made it waiting) rings nothing. `revived`:
# the steps a replayed step's death cancelled, directly or through others: the
# jobs_workflow_step_changed trigger (schema.sql) makes them wait again at the end of this
# statement, which still reads them as they were (blocked_by set), so it can name them.
REPLAY = Statement(
    """
WITH RECURSIVE locked AS (  -- in id order, as cancel and the fenced writes: never a deadlock
    SELECT j.id, j.queue, j.unique_key FROM @schema.jobs AS j
    WHERE j.status = 'dead'
      AND (:ids::bigint[] IS NULL OR j.id = ANY(:ids))
      AND (:task::text IS NULL OR j.task = :task)
      AND (:queue::text IS NULL OR j.queue = :queue)
    ORDER BY j.id
    FOR UPDATE
),
matching AS (
    SELECT l.id, l.unique_key, max(l.id) OVER (PARTITION BY l.unique_key) AS newest,
           (SELECT live.id FROM @schema.jobs AS live
            WHERE live.unique_key = l.unique_key AND live.status IN ('pending', 'running')
            LIMIT 1) AS live_id
    FROM locked AS l
),
changed AS (
    UPDATE @schema.jobs AS j
    SET status = 'pending', attempts = 0, run_at = now(),
        cancel_requested_at = NULL  -- a request that came too late ended with the run
    FROM matching AS m
    WHERE j.id = m.id AND (m.unique_key IS NULL OR (m.live_id IS NULL AND m.id = m.newest))
    RETURNING j.id, j.queue, j.status, j.workflow_id
),
revived(root, job_id) AS (
    SELECT id, id FROM changed WHERE workflow_id IS NOT NULL
    UNION
    SELECT r.root, b.id
    FROM revived AS r
    JOIN @schema.workflow_deps AS d ON d.parent_id = r.job_id
    JOIN @schema.jobs AS b ON b.id = d.job_id AND b.blocked_by = r.job_id
                              AND b.status = 'cancelled'
),
ready_queues(queue) AS (SELECT queue FROM changed WHERE status = 'pending' GROUP BY queue),
@rang
SELECT m.id, m.unique_key, c.id IS NOT NULL AS replayed, m.live_id, m.newest,
       ARRAY(SELECT r.job_id FROM revived AS r
             WHERE r.root = m.id AND r.job_id <> r.root ORDER BY r.job_id) AS revived,
       ARRAY(SELECT w.name FROM revived AS r
             JOIN @schema.workflow_steps AS w ON w.job_id = r.job_id
             WHERE r.root = m.id AND r.job_id <> r.root ORDER BY r.job_id) AS revived_names
FROM matching AS m
LEFT JOIN changed AS c ON c.id = m.id
WHERE (SELECT count(*) FROM rang) >= 0
ORDER BY m.id
""",
    columns(Replayed),
    ("ids", "task", "queue"),
)


@dataclass(frozen=True, slots=True)
class BlockedStep:
    """A workflow step cancelled because a dependency ended dead or cancelled, with the step
    whose end did it (its job id, status, and name; status ``deleted`` once its row is gone)."""

    id: int
    failed: int
    status: str
    name: str | None


# The cancelled workflow steps among :ids that the workflow trigger cancelled (blocked_by set,
# docs/architecture.md, "Workflows"), each with the step whose end cancelled it: blocked_by
# followed up to a step that was not itself cancelled so (ids decrease along the way: it ends).
# A replay does not take them (dead jobs only); their failed step's replay revives them.
BLOCKED_STEPS = Statement(
    """
WITH RECURSIVE up(id, failed, depth) AS (
    SELECT j.id, j.blocked_by, 1 FROM @schema.jobs AS j
    WHERE j.id = ANY(:ids::bigint[]) AND j.status = 'cancelled' AND j.blocked_by IS NOT NULL
    UNION ALL
    SELECT u.id, j.blocked_by, u.depth + 1
    FROM up AS u
    JOIN @schema.jobs AS j ON j.id = u.failed
    WHERE j.blocked_by IS NOT NULL
)
SELECT DISTINCT ON (u.id) u.id, u.failed, coalesce(j.status, 'deleted') AS status, s.name
FROM up AS u
LEFT JOIN @schema.jobs AS j ON j.id = u.failed
LEFT JOIN @schema.workflow_steps AS s ON s.job_id = u.failed
ORDER BY u.id, u.depth DESC
""",
    columns(BlockedStep),
    ("ids",),
)

# Delete pending, dead or cancelled jobs by id (a running job belongs to its worker: cancel it
# first); return the ids. A pending workflow step is kept: its dependents would wait for it
# for ever (cancel it: they are cancelled with it). The rows are locked first, in id order,
# whatever order the plan reads them in, as REPLAY and cancel lock theirs: two overlapping
# calls wait for each other, never deadlock.
DELETE_JOBS = Statement(
    """
WITH locked AS (
    SELECT j.id FROM @schema.jobs AS j
    WHERE j.id = ANY(:ids::bigint[]) AND j.status IN ('pending', 'dead', 'cancelled')
      AND NOT (j.status = 'pending' AND j.workflow_id IS NOT NULL)
    ORDER BY j.id
    FOR UPDATE OF j
)
DELETE FROM @schema.jobs AS j
USING locked
WHERE j.id = locked.id
RETURNING j.id
""",
    integer,
    ("ids",),
)


@dataclass(frozen=True, slots=True)
class QueueCounts:
    """What one queue holds now (ages in seconds of database time)."""

    queue: str
    ready: int
    scheduled: int
    running: int
    dead: int
    cancelled: int
    expired: int
    oldest_ready_age: float
    waiting: int


# Per queue: what `aioq stats`, aioq.admin.queues() and the metrics gauges show. One scan of
# the hot table (the backlog plus dead jobs), so the metrics sample it on an interval, never
# per scrape.
QUEUE_STATS = Statement(
    """
SELECT queue,
       count(*) FILTER (WHERE @ready) AS ready,
       count(*) FILTER (WHERE status = 'pending' AND run_at > now()) AS scheduled,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
       count(*) FILTER (WHERE status = 'running' AND lease_expires_at < now()) AS expired,
       coalesce(extract(epoch FROM now() - min(run_at)
                FILTER (WHERE @ready)), 0)::float8
           AS oldest_ready_age,
       count(*) FILTER (WHERE status = 'waiting') AS waiting
FROM @schema.jobs
GROUP BY queue
ORDER BY queue
""",
    columns(QueueCounts),
)


@dataclass(frozen=True, slots=True)
class QueueCompleted:
    """Jobs of a queue archived in the last minute."""

    queue: str
    completed: int


# Completions in the last minute, per queue; no rows at all when the archive is empty
# (completed jobs are deleted unless a worker keeps them, so an empty archive says nothing).
ARCHIVE_STATS = Statement(
    """
SELECT a.queue, count(*) FILTER (WHERE a.finished_at > now() - interval '1 minute') AS completed
FROM @schema.archive AS a
WHERE EXISTS (SELECT FROM @schema.archive)
GROUP BY a.queue
""",
    columns(QueueCompleted),
)


@dataclass(frozen=True, slots=True)
class TableFigures:
    """Size (bytes) and vacuum figures of the jobs table, from the statistics collector."""

    table_bytes: int
    index_bytes: int
    n_live_tup: int | None
    n_dead_tup: int | None
    last_autovacuum: datetime | None
    last_vacuum: datetime | None
    last_autoanalyze: datetime | None


TABLE_STATS = Statement(
    """
SELECT pg_table_size(c.oid) AS table_bytes, pg_indexes_size(c.oid) AS index_bytes,
       s.n_live_tup, s.n_dead_tup, s.last_autovacuum, s.last_vacuum, s.last_autoanalyze
FROM pg_class AS c
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE c.oid = '@schema.jobs'::regclass
""",
    columns(TableFigures),
)


@dataclass(frozen=True, slots=True)
class UnknownTaskJobs:
    """The jobs of one task and queue waiting for a worker that knows their task, and since
    when the first of them has (docs/architecture.md, "Unknown tasks")."""

    queue: str
    task: str
    jobs: int
    since: datetime


# Jobs waiting for a worker that knows their task: the partial index jobs_unknown_idx holds
# them and nothing else (none in a steady state).
UNKNOWN_TASKS = Statement(
    """
SELECT queue, task, count(*) AS jobs, min(unknown_since) AS since
FROM @schema.jobs
WHERE unknown_since IS NOT NULL AND status = 'pending'
GROUP BY queue, task
ORDER BY queue, task
""",
    columns(UnknownTaskJobs),
)

# The queues that hold a job ready to run now: the test drain (aioq.testing) serves these.
READY_QUEUES = Statement(
    """
SELECT DISTINCT queue FROM @schema.jobs WHERE @ready ORDER BY queue
""",
    text,
)


@dataclass(frozen=True, slots=True)
class TaskQueue:
    """A task and a queue that pending jobs are in."""

    task: str
    queue: str


# The tasks and queues of every pending job (due or scheduled): what the pytest plugin's worker
# left waiting, to tell a test why (a task its registry lacks, a queue it does not serve).
PENDING_TASKS = Statement(
    "SELECT DISTINCT task, queue FROM @schema.jobs WHERE status = 'pending' ORDER BY task, queue",
    columns(TaskQueue),
)


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A pending job, for assertions in tests (aioq.testing.deferred)."""

    id: int
    queue: str
    args: str
    priority: int
    run_at: datetime
    attempts: int
    max_attempts: int
    unique_key: str | None


# A task's pending jobs (due or scheduled), oldest first.
PENDING_JOBS = Statement(
    """
SELECT id, queue, args::text AS args, priority, run_at, attempts, max_attempts, unique_key
FROM @schema.jobs WHERE status = 'pending' AND task = :task
ORDER BY run_at, id
""",
    columns(PendingJob),
    ("task",),
)

# A savepoint in a synchronous caller's transaction (aioq.admin.replay_sync), so that a replay
# that loses a race on a unique key leaves that transaction usable; outside a transaction block
# (autocommit) SAVEPOINT fails, and no statement needs one.
SAVEPOINT = Statement("SAVEPOINT aioq_savepoint", nothing)
ROLLBACK_TO_SAVEPOINT = Statement("ROLLBACK TO SAVEPOINT aioq_savepoint", nothing)
RELEASE_SAVEPOINT = Statement("RELEASE SAVEPOINT aioq_savepoint", nothing)
