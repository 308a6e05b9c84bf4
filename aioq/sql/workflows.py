"""Workflows: a run's steps deferred together, read back, cancelled, pruned.
docs/architecture.md, "Workflows". The fan-in itself is in outcomes.WRITE_STEP_OUTCOMES.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.sql import Named, Row, Statement, columns, integer

__all__ = (
    "GET_WORKFLOW",
    "INSERT_WORKFLOW",
    "LIST_WORKFLOWS",
    "NEW_JOB_IDS",
    "PRUNE_WORKFLOWS",
    "UPSTREAM",
    "WORKFLOW_JOBS",
    "WORKFLOW_STEPS",
    "InsertWorkflow",
    "StepRow",
    "UpstreamRow",
    "WorkflowRow",
    "job_ids",
)


def job_ids(row: Row) -> list[int]:
    """A row of one array of job ids."""
    return list(row[0])


# The job ids a run's steps will take, from the jobs' identity sequence, in the order the steps
# were added (a dependency has a lower id than its dependents), so that INSERT_WORKFLOW's
# edges can name them. It writes nothing: ids it takes for a run never written are a gap.
NEW_JOB_IDS = Statement(
    """
SELECT ARRAY(SELECT nextval(pg_get_serial_sequence('@schema.jobs', 'id'))
             FROM generate_series(1, :steps))
""",
    job_ids,
    ("steps",),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertWorkflow:
    """A run and all its steps: its name; parallel lists, one element per step, in the order
    the steps were added (``ids`` from NEW_JOB_IDS); the edges (dependent and dependency job
    ids); and the traceparent of the run's defer (one for every step)."""

    name: str
    ids: list[int]
    queues: list[str]
    tasks: list[str]
    args: list[str]  # JSON text
    priorities: list[int]
    run_ats: list[datetime | None]  # None: now + delay
    delays: list[float]
    max_attempts: list[int]
    leases: list[float]
    concurrency_keys: list[str | None]
    names: list[str]
    remaining: list[int]  # how many dependencies each waits for
    on_failure: list[str]
    edge_steps: list[int]
    edge_parents: list[int]
    traceparent: str | None


# A run and all its steps in one statement, so that it is written whole or not at all whatever
# the connection's transaction state: on a connection in autocommit, a run written in several
# statements committed each on its own, and a step that ran and succeeded before a later
# statement wrote its edges never released the dependents those edges named
# (docs/architecture.md, "Workflows"). Returns the run's id. A step with dependencies waits
# (its delay kept on its step row: it counts from the moment the step becomes ready); the
# others are pending, and the doorbells of the queues of those claimable now (no dependency, no
# delay) ring.
INSERT_WORKFLOW = Named(
    InsertWorkflow,
    """
WITH run AS (
    INSERT INTO @schema.workflows (name, steps) VALUES (:name, cardinality(:ids::bigint[]))
    RETURNING id
),
steps AS (
    SELECT * FROM unnest(:ids::bigint[], :queues::text[], :tasks::text[], :args::text[],
                         :priorities::integer[], :run_ats::timestamptz[], :delays::float8[],
                         :max_attempts::integer[], :leases::float8[],
                         :concurrency_keys::text[], :names::text[], :remaining::integer[],
                         :on_failure::text[])
        WITH ORDINALITY AS s(id, queue, task, args, priority, run_at, delay, max_attempts,
                             lease, concurrency_key, name, remaining, on_failure, n)
),
inserted AS (
    INSERT INTO @schema.jobs (id, queue, task, args, status, priority, run_at, max_attempts,
                              lease, concurrency_key, workflow_id, traceparent)
    OVERRIDING SYSTEM VALUE
    SELECT s.id, s.queue, s.task, s.args::jsonb,
           CASE WHEN s.remaining > 0 THEN 'waiting' ELSE 'pending' END, s.priority,
           coalesce(s.run_at, now() + make_interval(secs => s.delay)), s.max_attempts,
           make_interval(secs => s.lease), s.concurrency_key, run.id, :traceparent::text
    FROM steps AS s CROSS JOIN run
    ORDER BY s.n
),
step_rows AS (
    INSERT INTO @schema.workflow_steps (job_id, workflow_id, name, task, remaining, on_failure,
                                        delay)
    SELECT s.id, run.id, s.name, s.task, s.remaining, s.on_failure,
           CASE WHEN s.remaining > 0 AND s.run_at IS NULL AND s.delay > 0
                THEN make_interval(secs => s.delay) END
    FROM steps AS s CROSS JOIN run
),
edges AS (
    INSERT INTO @schema.workflow_deps (job_id, parent_id)
    SELECT e.job_id, e.parent_id
    FROM unnest(:edge_steps::bigint[], :edge_parents::bigint[]) AS e(job_id, parent_id)
),
ready_queues(queue) AS (
    SELECT DISTINCT queue FROM steps
    WHERE remaining = 0 AND coalesce(run_at, now() + make_interval(secs => delay)) <= now()
),
@rang
SELECT id FROM run WHERE (SELECT count(*) FROM rang) >= 0
""",
    integer,
)


@dataclass(frozen=True, slots=True)
class WorkflowRow:
    """A run as listed: its name, when it was deferred, its steps counted by status."""

    id: int
    name: str
    created_at: datetime
    steps: int
    waiting: int
    pending: int
    running: int
    succeeded: int
    dead: int
    cancelled: int


# A run's steps by status: a step's job row has its live or kept status; a step whose row is
# gone succeeded if its success was recorded (else it was deleted: counted nowhere).
GET_WORKFLOW = Statement(
    """
SELECT w.id, w.name, w.created_at, w.steps,
       count(*) FILTER (WHERE j.status = 'waiting')::integer AS waiting,
       count(*) FILTER (WHERE j.status = 'pending')::integer AS pending,
       count(*) FILTER (WHERE j.status = 'running')::integer AS running,
       count(*) FILTER (WHERE j.id IS NULL AND s.succeeded_at IS NOT NULL)::integer AS succeeded,
       count(*) FILTER (WHERE j.status = 'dead')::integer AS dead,
       count(*) FILTER (WHERE j.status = 'cancelled')::integer AS cancelled
FROM @schema.workflows AS w
LEFT JOIN @schema.workflow_steps AS s ON s.workflow_id = w.id
LEFT JOIN @schema.jobs AS j ON j.id = s.job_id
WHERE w.id = :workflow
GROUP BY w.id
""",
    columns(WorkflowRow),
    ("workflow",),
)


# The newest runs first: at most :limit, of a :name (NULL: any). Succeeded steps are the run's
# own count (kept by WRITE_STEP_OUTCOMES); the steps still in jobs are counted per status up to
# :bound + 1 (more than :bound: ":bound+") by the schema's workflow_counts(), one bounded
# index range per status, so a page of runs of 100 000 steps never reads every step.
LIST_WORKFLOWS = Statement(
    """
WITH newest AS (
    SELECT id FROM @schema.workflows
    WHERE (:name::text IS NULL OR name = :name)
    ORDER BY id DESC LIMIT :limit
)
SELECT w.id, w.name, w.created_at, w.steps, c.waiting, c.pending, c.running, w.succeeded,
       c.dead, c.cancelled
FROM newest
JOIN @schema.workflows AS w USING (id)
CROSS JOIN LATERAL @schema.workflow_counts(w.id, :bound::integer) AS c
ORDER BY w.id DESC
""",
    columns(WorkflowRow),
    ("limit", "name", "bound"),
)


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step of a run: its name, job, status, dependencies, error and result."""

    job_id: int
    name: str
    task: str
    queue: str | None
    status: str
    after: list[str]
    on_failure: str
    attempts: int | None
    last_error: str | None
    result: str | None


WORKFLOW_STEPS = Statement(
    """
SELECT s.job_id, s.name, s.task, j.queue,
       coalesce(j.status, CASE WHEN s.succeeded_at IS NOT NULL THEN 'succeeded' ELSE 'deleted' END)
           AS status,
       ARRAY(SELECT p.name FROM @schema.workflow_deps AS d
             JOIN @schema.workflow_steps AS p ON p.job_id = d.parent_id
             WHERE d.job_id = s.job_id ORDER BY p.job_id) AS after,
       s.on_failure, j.attempts, j.last_error, s.result::text AS result
FROM @schema.workflow_steps AS s
LEFT JOIN @schema.jobs AS j ON j.id = s.job_id
WHERE s.workflow_id = :workflow
ORDER BY s.job_id
""",
    columns(StepRow),
    ("workflow",),
)

# The job ids of a run's steps that may still run (for cancel_workflow).
WORKFLOW_JOBS = Statement(
    """
SELECT id FROM @schema.jobs
WHERE workflow_id = :workflow AND status IN ('waiting', 'pending', 'running')
ORDER BY id
""",
    integer,
    ("workflow",),
)


@dataclass(frozen=True, slots=True)
class UpstreamRow:
    """A direct dependency of a step: its name, task, status and result (JSON) or error."""

    name: str
    job_id: int
    task: str
    status: str
    result: str | None
    last_error: str | None


# The direct dependencies of a step (:id its job).
UPSTREAM = Statement(
    """
SELECT p.name, p.job_id, p.task,
       coalesce(j.status, CASE WHEN p.succeeded_at IS NOT NULL THEN 'succeeded' ELSE 'deleted' END)
           AS status,
       p.result::text AS result, j.last_error
FROM @schema.workflow_deps AS d
JOIN @schema.workflow_steps AS p ON p.job_id = d.parent_id
LEFT JOIN @schema.jobs AS j ON j.id = p.job_id
WHERE d.job_id = :id
ORDER BY p.job_id
""",
    columns(UpstreamRow),
    ("id",),
)

# Runs older than :age seconds none of whose steps is still in the jobs table (every step
# succeeded, or its kept row was pruned): their steps, edges and results go, at most :limit runs
# per pass. Returns how many runs it deleted.
PRUNE_WORKFLOWS = Statement(
    """
WITH old AS (
    SELECT w.id FROM @schema.workflows AS w
    WHERE w.created_at < now() - make_interval(secs => :age::float8)
      AND NOT EXISTS (SELECT FROM @schema.jobs AS j WHERE j.workflow_id = w.id)
    ORDER BY w.id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
),
steps AS (
    DELETE FROM @schema.workflow_steps AS s USING old WHERE s.workflow_id = old.id
    RETURNING s.job_id
),
edges AS (
    DELETE FROM @schema.workflow_deps AS d USING steps WHERE d.job_id = steps.job_id
),
gone AS (
    DELETE FROM @schema.workflows AS w USING old WHERE w.id = old.id
    RETURNING w.id
)
SELECT count(*) FROM gone
""",
    integer,
    ("age", "limit"),
)
