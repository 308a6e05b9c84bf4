"""Workflows: a run's steps deferred together, read back, cancelled, pruned.
docs/architecture.md, "Workflows". The fan-in itself is in outcomes.WRITE_STEP_OUTCOMES.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.sql import Statement, columns, integer
from aioq.sql.doorbell import ring

__all__ = (
    "CREATE_WORKFLOW",
    "GET_WORKFLOW",
    "INSERT_STEPS",
    "LIST_WORKFLOWS",
    "PRUNE_WORKFLOWS",
    "UPSTREAM",
    "WORKFLOW_JOBS",
    "WORKFLOW_STEPS",
    "NewWorkflow",
    "StepRow",
    "UpstreamRow",
    "WorkflowRow",
)


@dataclass(frozen=True, slots=True)
class NewWorkflow:
    """A run's id and the job ids its steps will take, in order."""

    id: int
    ids: list[int]


# $1 the name, $2 the number of steps: the run's row, and its steps' job ids taken from the jobs'
# identity sequence in one round trip, so each batch of steps can name its dependencies' ids.
CREATE_WORKFLOW = Statement(
    """
WITH w AS (
    INSERT INTO {s}.workflows (name, steps) VALUES ($1, $2) RETURNING id
)
SELECT w.id, ARRAY(SELECT nextval(pg_get_serial_sequence('{s}.jobs', 'id'))
                   FROM generate_series(1, $2)) AS ids
FROM w
""",
    columns(NewWorkflow),
)

# The queues of a batch's steps that are claimable at once: no dependency, no delay.
_READY_STEPS = """SELECT DISTINCT queue FROM steps
    WHERE remaining = 0 AND coalesce(run_at, now() + make_interval(secs => delay)) <= now()"""

# One batch of steps: $1 the run, then per step $2 job id, $3 queue, $4 task, $5 args (JSON),
# $6 priority, $7 run_at (NULL: now + $8 seconds), $9 max_attempts, $10 lease seconds,
# $11 concurrency key, $12 name, $13 dependencies, $14 on_failure; and the edges of the batch's
# steps, $15 dependent and $16 dependency job ids; $17 the traceparent of the run's defer (one
# for every step). A step with dependencies waits (its delay kept on its step row: it counts
# from the moment the step becomes ready); the others are pending, and their queues' doorbells
# ring (those claimable now).
INSERT_STEPS = Statement(
    """
WITH steps AS (
    SELECT * FROM unnest($2::bigint[], $3::text[], $4::text[], $5::text[], $6::integer[],
                         $7::timestamptz[], $8::float8[], $9::integer[], $10::float8[],
                         $11::text[], $12::text[], $13::integer[], $14::text[])
        WITH ORDINALITY AS s(id, queue, task, args, priority, run_at, delay, max_attempts,
                             lease, concurrency_key, name, remaining, on_failure, n)
),
inserted AS (
    INSERT INTO {s}.jobs (id, queue, task, args, status, priority, run_at, max_attempts, lease,
                          concurrency_key, workflow_id, traceparent)
    OVERRIDING SYSTEM VALUE
    SELECT id, queue, task, args::jsonb,
           CASE WHEN remaining > 0 THEN 'waiting' ELSE 'pending' END, priority,
           coalesce(run_at, now() + make_interval(secs => delay)), max_attempts,
           make_interval(secs => lease), concurrency_key, $1, $17::text
    FROM steps ORDER BY n
    RETURNING id
),
step_rows AS (
    INSERT INTO {s}.workflow_steps (job_id, workflow_id, name, task, remaining, on_failure, delay)
    SELECT id, $1, name, task, remaining, on_failure,
           CASE WHEN remaining > 0 AND run_at IS NULL AND delay > 0
                THEN make_interval(secs => delay) END
    FROM steps
),
edges AS (
    INSERT INTO {s}.workflow_deps (job_id, parent_id)
    SELECT e.job_id, e.parent_id FROM unnest($15::bigint[], $16::bigint[]) AS e(job_id, parent_id)
),
"""
    + ring(_READY_STEPS)
    + """
SELECT count(*) FROM inserted WHERE (SELECT count(*) FROM rang) >= 0
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
_COUNTS = """
SELECT w.id, w.name, w.created_at, w.steps,
       count(*) FILTER (WHERE j.status = 'waiting')::integer AS waiting,
       count(*) FILTER (WHERE j.status = 'pending')::integer AS pending,
       count(*) FILTER (WHERE j.status = 'running')::integer AS running,
       count(*) FILTER (WHERE j.id IS NULL AND s.succeeded_at IS NOT NULL)::integer AS succeeded,
       count(*) FILTER (WHERE j.status = 'dead')::integer AS dead,
       count(*) FILTER (WHERE j.status = 'cancelled')::integer AS cancelled
FROM {s}.workflows AS w
LEFT JOIN {s}.workflow_steps AS s ON s.workflow_id = w.id
LEFT JOIN {s}.jobs AS j ON j.id = s.job_id
"""

GET_WORKFLOW = Statement(_COUNTS + "WHERE w.id = $1\nGROUP BY w.id\n", columns(WorkflowRow))


# The newest runs first; $1 how many, $2 a name (NULL: any), $3 the bound. Succeeded steps are
# the run's own count (kept by WRITE_STEP_OUTCOMES); the steps still in jobs are counted per
# status up to $3 + 1 (more than $3: "$3+") by the schema's workflow_counts(), one bounded
# index range per status, so a page of runs of 100 000 steps never reads every step.
LIST_WORKFLOWS = Statement(
    """
WITH newest AS (
    SELECT id FROM {s}.workflows
    WHERE ($2::text IS NULL OR name = $2)
    ORDER BY id DESC LIMIT $1
)
SELECT w.id, w.name, w.created_at, w.steps, c.waiting, c.pending, c.running, w.succeeded,
       c.dead, c.cancelled
FROM newest
JOIN {s}.workflows AS w USING (id)
CROSS JOIN LATERAL {s}.workflow_counts(w.id, $3::integer) AS c
ORDER BY w.id DESC
""",
    columns(WorkflowRow),
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
       ARRAY(SELECT p.name FROM {s}.workflow_deps AS d
             JOIN {s}.workflow_steps AS p ON p.job_id = d.parent_id
             WHERE d.job_id = s.job_id ORDER BY p.job_id) AS after,
       s.on_failure, j.attempts, j.last_error, s.result::text AS result
FROM {s}.workflow_steps AS s
LEFT JOIN {s}.jobs AS j ON j.id = s.job_id
WHERE s.workflow_id = $1
ORDER BY s.job_id
""",
    columns(StepRow),
)

# The job ids of a run's steps that may still run (for cancel_workflow).
WORKFLOW_JOBS = Statement(
    """
SELECT id FROM {s}.jobs
WHERE workflow_id = $1 AND status IN ('waiting', 'pending', 'running')
ORDER BY id
""",
    integer,
)


@dataclass(frozen=True, slots=True)
class UpstreamRow:
    """A direct dependency of a step: its name, status and result (JSON) or error."""

    name: str
    job_id: int
    status: str
    result: str | None
    last_error: str | None


# $1 the step's job id.
UPSTREAM = Statement(
    """
SELECT p.name, p.job_id,
       coalesce(j.status, CASE WHEN p.succeeded_at IS NOT NULL THEN 'succeeded' ELSE 'deleted' END)
           AS status,
       p.result::text AS result, j.last_error
FROM {s}.workflow_deps AS d
JOIN {s}.workflow_steps AS p ON p.job_id = d.parent_id
LEFT JOIN {s}.jobs AS j ON j.id = p.job_id
WHERE d.job_id = $1
ORDER BY p.job_id
""",
    columns(UpstreamRow),
)

# Runs older than $1 seconds none of whose steps is still in the jobs table (every step
# succeeded, or its kept row was pruned): their steps, edges and results go, at most $2 runs
# per pass. Returns how many runs it deleted.
PRUNE_WORKFLOWS = Statement(
    """
WITH old AS (
    SELECT w.id FROM {s}.workflows AS w
    WHERE w.created_at < now() - make_interval(secs => $1::float8)
      AND NOT EXISTS (SELECT FROM {s}.jobs AS j WHERE j.workflow_id = w.id)
    ORDER BY w.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
steps AS (
    DELETE FROM {s}.workflow_steps AS s USING old WHERE s.workflow_id = old.id
    RETURNING s.job_id
),
edges AS (
    DELETE FROM {s}.workflow_deps AS d USING steps WHERE d.job_id = steps.job_id
),
gone AS (
    DELETE FROM {s}.workflows AS w USING old WHERE w.id = old.id
    RETURNING w.id
)
SELECT count(*) FROM gone
""",
    integer,
)
