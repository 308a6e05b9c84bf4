"""Every write after the claim, fenced on it: outcomes, heartbeat, release, the reaper.

docs/architecture.md, "The fence": a write after the claim names the claim it belongs to,
``(id, claims)``, and this worker (``locked_by``), and applies only while the job is
``running``. ``claims`` only grows, so a worker that lost its lease, or retries a write whose
reply it never saw, changes nothing. The fenced writes take ``$1`` the job ids and ``$2`` their
claim numbers (Claim.key, as two arrays) and ``$3`` the worker, and first lock their rows in one
order (``ORDER BY id``) so that the heartbeat, the completer and a release never wait on each
other in opposite orders (a deadlock). The claim and the reaper take rows with SKIP LOCKED:
they never wait, so they cannot take part in one.

A NOTIFY per queue whose rows became ready goes out at commit from a ``rang`` CTE
(aioq.sql.doorbell.ring: only for queues a worker is on duty for). PostgreSQL runs a CTE that is
not data-modifying only if the statement reads it, hence the
``WHERE (SELECT count(*) FROM rang) >= 0``: always true, it makes the statement read ``rang``.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioq.sql import Row, Statement, columns, integer
from aioq.sql.doorbell import ring

__all__ = (
    "COMPLETE",
    "FENCE",
    "HEARTBEAT",
    "REAP",
    "RELEASE_WORKER",
    "WRITE_OUTCOMES",
    "WRITE_STEP_OUTCOMES",
    "Rescued",
    "by_id",
    "claim_key",
    "fenced",
)

FENCE = "j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'"
"""The fence: row ``j`` is still held by the claim ``f.claim`` of worker ``$3``."""


def by_id(extra_columns: str = "", lock: str = "") -> str:
    """Row ``j`` of each ``f.id``, looked up by its primary key whatever the statistics say,
    with the columns the fence tests (and more); ``lock`` a locking clause (``FOR UPDATE``)
    taken as each row is found. A join left to the planner walked the running rows and
    rescanned the id arrays for each when the last ANALYZE saw none running (a quiet queue
    before a burst): time in running rows x batch, a second per batch at concurrency 1 000
    (docs/architecture.md, "The fence")."""
    locking = f"\n    {lock}" if lock else ""
    return f"""CROSS JOIN LATERAL (
    SELECT j.id, j.claims, j.locked_by, j.status{extra_columns} FROM {{s}}.jobs AS j
    WHERE j.id = f.id
    OFFSET 0  -- keeps the fence's status test out: it would pick the running rows' index{locking}
) AS j"""


def fenced(extra_columns: str = "", extra_arrays: str = "", extra_names: str = "") -> str:
    """The ``mine`` CTE: the rows of ``$1``/``$2`` (ids, claim numbers) still held under the
    fence, locked in id order, with per-job values from more arrays beside them.

    Each row is looked up by its primary key (:func:`by_id`), in id order, locked as it is
    found.
    """
    return f"""mine AS (
    SELECT j.id{extra_columns}
    FROM (SELECT * FROM unnest($1::bigint[], $2::integer[]{extra_arrays})
          AS u(id, claim{extra_names}) ORDER BY id) AS f
    {by_id(lock="FOR UPDATE")}
    WHERE {FENCE}
)"""


# The columns that end a claim without deleting the row (retried, dead, cancelled, released,
# rescued); last_worker keeps where it last ran.
CLEAR_CLAIM = """last_worker = j.locked_by, locked_by = NULL, locked_at = NULL,
        lease_expires_at = NULL"""

# Where a job goes when it leaves `running` for another run: pending, unless a cancel was
# requested (docs/architecture.md, "Job control"): then it is cancelled and never runs again.
AGAIN = "CASE WHEN j.cancel_requested_at IS NULL THEN 'pending' ELSE 'cancelled' END"


# The outcomes of a batch of attempts, of every kind, in one statement. Per job: $4 the kind
# (OutcomeKind's value), $5 the delay before it is pending again (seconds), $6 the error to
# record, $7 the return value to keep (JSON text), $8 how long to keep it (NULL: the task keeps
# no result, and nobody awaits the job). $9: keep succeeded jobs in the archive. $10: the
# results channel, rung for every awaited job that ended (succeeded, dead or cancelled).
# - succeeded: the row leaves the table (into results and the archive when asked);
# - retried: pending after the delay, the error recorded; snoozed (aioq.Retry): pending after
#   the delay, and one more attempt allowed (max_attempts + 1), so that snoozing never spends
#   the failure budget; released: pending now, the attempt refunded;
# - dead: the error recorded; cancelled: kept as cancelled. Both set run_at to now, the
#   pruner's clock.
# Returns the ids written: a job missing from them was no longer held by the claim.
def _write_outcomes(steps: str = "", step_reads: str = "", also_ready: str = "") -> str:
    """WRITE_OUTCOMES' text, with more CTEs (``steps``), their forced reads, and a query of
    more queues whose jobs they made claimable now (``also_ready``), rung with the others."""
    ready = "SELECT queue FROM changed WHERE status = 'pending' AND delay = 0" + (
        f" UNION {also_ready}" if also_ready else " GROUP BY queue"
    )
    return (
        "WITH "
        + fenced(
            ", f.kind, f.delay, f.error, f.result, f.ttl",
            ", $4::text[], $5::float8[], $6::text[], $7::text[], $8::float8[]",
            ", kind, delay, error, result, ttl",
        )
        + f""",
done AS (
    DELETE FROM {{s}}.jobs AS j
    USING mine AS m
    WHERE j.id = m.id AND m.kind = 'succeeded'
    RETURNING j.id
),
-- The copies read the rows as the statement's snapshot has them (sibling CTEs do not see each
-- other's changes): the rows `mine` locked and `done` deletes. Reading them here rather than
-- from `done`'s RETURNING keeps a plain completion from copying every row's arguments.
succeeded AS (
    SELECT j.id, j.queue, j.task, j.args, j.priority, j.attempts, j.max_attempts, j.locked_by,
           j.locked_at, j.created_at, j.progress, j.progress_note, m.result, m.ttl
    FROM mine AS m
    JOIN {{s}}.jobs AS j ON j.id = m.id
    WHERE m.kind = 'succeeded' AND (m.ttl IS NOT NULL OR $9::boolean)
),
kept AS (
    INSERT INTO {{s}}.results (id, queue, task, args, priority, attempts, max_attempts, worker,
                             progress, progress_note, created_at, started_at, finished_at,
                             expires_at, result)
    SELECT id, queue, task, args, priority, attempts, max_attempts, locked_by, progress,
           progress_note, created_at, locked_at, clock_timestamp(),
           clock_timestamp() + make_interval(secs => ttl), result::jsonb
    FROM succeeded WHERE ttl IS NOT NULL
    RETURNING id
),
archived AS (
    INSERT INTO {{s}}.archive (id, queue, task, args, priority, attempts, max_attempts, worker,
                             created_at, started_at, finished_at)
    SELECT id, queue, task, args, priority, attempts, max_attempts, locked_by,
           created_at, locked_at, clock_timestamp()
    FROM succeeded WHERE $9::boolean
),
changed AS (
    UPDATE {{s}}.jobs AS j
    SET status = CASE m.kind WHEN 'dead' THEN 'dead' WHEN 'cancelled' THEN 'cancelled'
                 ELSE {AGAIN} END,
        run_at = now() + make_interval(secs => m.delay),
        last_error = CASE WHEN m.kind IN ('retried', 'dead') THEN coalesce(m.error, j.last_error)
                     ELSE j.last_error END,
        attempts = j.attempts - CASE WHEN m.kind = 'released' THEN 1 ELSE 0 END,
        max_attempts = j.max_attempts + CASE WHEN m.kind = 'snoozed' THEN 1 ELSE 0 END,
        snoozes = j.snoozes + CASE WHEN m.kind = 'snoozed' THEN 1 ELSE 0 END,
        cancel_requested_at = CASE WHEN m.kind = 'cancelled'
                              THEN coalesce(j.cancel_requested_at, now())
                              ELSE j.cancel_requested_at END,
        {CLEAR_CLAIM}
    FROM mine AS m
    WHERE j.id = m.id AND m.kind <> 'succeeded'
    RETURNING j.id, j.queue, j.status, m.delay, m.ttl IS NOT NULL AS awaited
),{steps}
{ring(ready)},
told AS (
    SELECT pg_notify($10, id::text) FROM kept
    UNION ALL
    SELECT pg_notify($10, id::text) FROM changed WHERE awaited AND status <> 'pending'
)
SELECT id FROM (SELECT id FROM done UNION ALL SELECT id FROM changed) AS written
WHERE (SELECT count(*) FROM rang) >= 0 AND (SELECT count(*) FROM told) >= 0{step_reads}
"""
    )


WRITE_OUTCOMES = Statement(_write_outcomes(), integer)

# WRITE_OUTCOMES for a batch that holds workflow steps (docs/architecture.md, "Workflows"): the
# same outcomes, and for each step that succeeded, its result kept on its step row and its
# dependents' remaining counts decremented; a dependent that reaches zero becomes pending in
# this statement, and its queue's doorbell rings at commit (with the other queues' rang). A success is recorded once (the
# fence: `done` holds the rows this statement deleted), so each decrement happens once, and the
# dependent's step row lock (taken in id order, before its job row) serializes the parents that
# finish at once on other workers: exactly one of them sees zero. Dead and cancelled steps
# cancel their dependents through the jobs_workflow_step_changed trigger (schema.sql), whatever
# wrote them. Plain batches keep COMPLETE or WRITE_OUTCOMES: none of this costs them. Rows are
# found by `= ANY(ARRAY(...))`, looked up in the primary keys whatever the estimates (a run's
# rows are often all inserted since the last ANALYZE: a join would scan them).
WRITE_STEP_OUTCOMES = Statement(
    _write_outcomes(
        """
recorded AS (
    UPDATE {s}.workflow_steps AS w
    SET succeeded_at = clock_timestamp(), result = coalesce(r.result, 'null')::jsonb
    FROM (SELECT m.id, m.result FROM done JOIN mine AS m ON m.id = done.id) AS r
    WHERE w.job_id = ANY(ARRAY(SELECT id FROM done)) AND w.job_id = r.id
    RETURNING w.job_id, w.workflow_id
),
counted AS (
    SELECT d.job_id, count(*)::integer AS n
    FROM {s}.workflow_deps AS d
    WHERE d.parent_id = ANY(ARRAY(SELECT id FROM done))
    GROUP BY d.job_id
),
dependents AS (
    SELECT w.job_id FROM {s}.workflow_steps AS w
    WHERE w.job_id = ANY(ARRAY(SELECT job_id FROM counted))
    ORDER BY w.job_id
    FOR UPDATE OF w
),
decremented AS (
    UPDATE {s}.workflow_steps AS w SET remaining = w.remaining - c.n
    FROM counted AS c
    WHERE w.job_id = ANY(ARRAY(SELECT job_id FROM dependents)) AND w.job_id = c.job_id
    RETURNING w.job_id, w.remaining, w.delay
),
-- A step's delay counts from now, the moment it became ready; a step without one runs now,
-- or at the time it was deferred for.
released AS (
    UPDATE {s}.jobs AS j SET status = 'pending',
        run_at = CASE WHEN d.delay IS NULL THEN greatest(j.run_at, now()) ELSE now() + d.delay END
    FROM decremented AS d
    WHERE j.id = ANY(ARRAY(SELECT job_id FROM decremented WHERE remaining <= 0))
      AND j.id = d.job_id AND j.status = 'waiting'
    RETURNING j.queue, j.run_at
),
-- Each run's count of succeeded steps (what the workflows list shows), one row per run and
-- batch. Read by nothing, this runs after the rest of the statement: its run rows are the last
-- locks it takes, in id order, and nothing else locks a run row but the pruner (SKIP LOCKED).
runs AS (
    SELECT w.id, c.n FROM {s}.workflows AS w
    JOIN (SELECT workflow_id, count(*)::integer AS n FROM recorded GROUP BY workflow_id) AS c
         ON c.workflow_id = w.id
    ORDER BY w.id
    FOR UPDATE OF w
),
progressed AS (
    UPDATE {s}.workflows AS w SET succeeded = w.succeeded + r.n
    FROM runs AS r
    WHERE w.id = r.id
),""",
        "\n  AND (SELECT count(*) FROM recorded) >= 0",
        "SELECT queue FROM released WHERE run_at <= now()",
    ),
    integer,
)

# WRITE_OUTCOMES for the hot path's batch: plain completions only (no result kept, no archive),
# with the same fence and locks. Measured on one connection, interleaved, a batch of 50: 11.7 ms
# against WRITE_OUTCOMES' 17.0 ms (its five more arrays and CTEs cost even when unused).
COMPLETE = Statement(
    "WITH "
    + fenced()
    + """
DELETE FROM {s}.jobs AS j
USING mine
WHERE j.id = mine.id
RETURNING j.id
""",
    integer,
)


def claim_key(row: Row) -> tuple[int, int]:
    """The row's claim: (job id, claim number)."""
    return int(row[0]), int(row[1])


# The claims still held, as (id, claim number): a worker may hold two claims of one job (it
# claimed it again after its loop was blocked past the lease and the job was rescued), of
# which only the newer can be held; the id alone would keep the lost one alive.
HEARTBEAT = Statement(
    "WITH "
    + fenced()
    + """
UPDATE {s}.jobs AS j
SET lease_expires_at = now() + j.lease
FROM mine
WHERE j.id = mine.id
RETURNING j.id, j.claims
""",
    claim_key,
)

# Every row still running under this worker's id ($1) goes back to pending with its attempt
# refunded, except the jobs in $2 (the claims it holds). On shutdown (keeping only jobs whose
# thread still runs), and after a claim whose reply was lost: this covers the claims the
# worker never saw.
RELEASE_WORKER = Statement(
    f"""
WITH mine AS (
    SELECT id FROM {{s}}.jobs
    WHERE locked_by = $1 AND status = 'running' AND id <> ALL($2::bigint[])
    ORDER BY id
    FOR UPDATE
),
changed AS (
    UPDATE {{s}}.jobs AS j
    SET status = {AGAIN}, run_at = now(), attempts = greatest(j.attempts - 1, 0),
        {CLEAR_CLAIM}
    FROM mine
    WHERE j.id = mine.id
    RETURNING j.id, j.queue, j.status
),
{ring("SELECT queue FROM changed WHERE status = 'pending' GROUP BY queue")}
SELECT id FROM changed WHERE (SELECT count(*) FROM rang) >= 0
""",
    integer,
)


@dataclass(frozen=True, slots=True)
class Rescued:
    """A job the reaper took back from an expired claim, and the status it got."""

    id: int
    status: str


# Expired leases: back to pending, or dead when the attempts are spent, or cancelled when a
# cancel was requested. At most $1 per pass.
# $2: the reaping worker, whose own claims are left alone: a late heartbeat (an event loop
# blocked by a task) must not make a worker rescue the jobs it is running, and a list of the
# claims it holds would be stale by the time the statement runs. Other workers rescue them
# if it is really gone; its own orphans (a claim whose reply was lost) it releases itself.
REAP = Statement(
    f"""
WITH expired AS (
    SELECT id FROM {{s}}.jobs
    WHERE status = 'running' AND lease_expires_at < now()
      AND locked_by IS DISTINCT FROM $2::text
    ORDER BY lease_expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
changed AS (
    UPDATE {{s}}.jobs AS j
    SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                      WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'pending' END,
        run_at = now(),
        -- A job cancelled with a reason (a cancelled workflow run) keeps it: that is why it
        -- ended; any other rescue records the lost lease.
        last_error = CASE WHEN j.cancel_requested_at IS NOT NULL AND j.last_error LIKE 'cancelled:%'
                          THEN j.last_error
                          ELSE format('LeaseExpired: worker %s held attempt %s past its lease',
                                      j.locked_by, j.attempts) END,
        {CLEAR_CLAIM}
    FROM expired
    WHERE j.id = expired.id
    RETURNING j.id, j.queue, j.status
),
{ring("SELECT queue FROM changed WHERE status = 'pending' GROUP BY queue")}
SELECT id, status FROM changed WHERE (SELECT count(*) FROM rang) >= 0
""",
    columns(Rescued),
)
