"""Job control from outside a worker and inside it: cancel requests, progress, awaited results.

docs/architecture.md, "Job control".
"""

from __future__ import annotations

from dataclasses import dataclass

from aioq.sql import Named, Statement, columns, integer

__all__ = (
    "CANCEL_JOBS",
    "CANCEL_REQUESTED",
    "RESULT_STATE",
    "SET_PROGRESS",
    "CancelState",
    "ResultState",
    "SetProgress",
)


@dataclass(frozen=True, slots=True)
class CancelState:
    """What a cancel request found a job in: cancelled, cancelling, dead, finished, missing,
    or raced (it changed while the statement ran: ask again)."""

    id: int
    state: str


# Pending (ready or scheduled) jobs and waiting workflow steps become cancelled at once (cancel);
# running ones get a cancel request that their worker acts on (a NOTIFY on the control channel
# now, its cancel watch within a heartbeat interval otherwise). One UPDATE for both, so a job
# claimed while this statement waits for its row lock is re-checked as running and still gets
# its request. :ids the jobs, :control_channel, :results_channel (waiters of a job cancelled
# while pending), :reason recorded as last_error of every job it cancels or asks to cancel
# (NULL: none; a running job keeps it when its worker records the cancel: the outcome leaves
# last_error).
# A row that was live in this statement's snapshot but that the UPDATE did not change ended
# (or changed hands) concurrently: 'raced', and the caller asks again with a fresh snapshot.
CANCEL_JOBS = Statement(
    """
WITH wanted AS (
    SELECT DISTINCT id FROM unnest(:ids::bigint[]) AS w(id)
),
locked AS (  -- in id order, like the fenced writes: two statements never deadlock
    SELECT j.id FROM @schema.jobs AS j
    WHERE j.id IN (SELECT id FROM wanted) AND j.status IN ('pending', 'waiting', 'running')
    ORDER BY j.id
    FOR UPDATE OF j
),
changed AS (
    UPDATE @schema.jobs AS j
    SET status = CASE WHEN j.status = 'running' THEN j.status ELSE 'cancelled' END,
        run_at = CASE WHEN j.status = 'running' THEN j.run_at ELSE now() END,
        cancel_requested_at = coalesce(j.cancel_requested_at, now()),
        last_error = coalesce(:reason::text, j.last_error)
    FROM locked
    WHERE j.id = locked.id AND j.status IN ('pending', 'waiting', 'running')
    RETURNING j.id, j.status
),
rang AS (
    SELECT pg_notify(CASE WHEN status = 'running' THEN :control_channel ELSE :results_channel END,
                     id::text)
    FROM changed
)
SELECT w.id,
       CASE WHEN c.status = 'cancelled' THEN 'cancelled'
            WHEN c.status = 'running' THEN 'cancelling'
            WHEN j.status IN ('dead', 'cancelled') THEN j.status
            WHEN j.status IS NOT NULL THEN 'raced'
            WHEN EXISTS (SELECT FROM @schema.results AS r WHERE r.id = w.id)
              OR EXISTS (SELECT FROM @schema.archive AS a WHERE a.id = w.id) THEN 'finished'
            ELSE 'missing'
       END AS state
FROM wanted AS w
LEFT JOIN changed AS c ON c.id = w.id
LEFT JOIN @schema.jobs AS j ON j.id = w.id
WHERE (SELECT count(*) FROM rang) >= 0
ORDER BY w.id
""",
    columns(CancelState),
    ("ids", "control_channel", "results_channel", "reason"),
)

# Our running jobs that someone asked to cancel: what the cancel watch delivers when the
# control channel's notification was missed: :ids, their claim numbers (:claims), :worker. A
# read: no row lock, so it never waits on (or for) the fenced writes.
CANCEL_REQUESTED = Statement(
    """
SELECT j.id FROM unnest(:ids::bigint[], :claims::integer[]) AS f(id, claim)
CROSS JOIN LATERAL (
    @by_id
) AS j
WHERE @fence AND j.cancel_requested_at IS NOT NULL
""",
    integer,
    ("ids", "claims", "worker"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SetProgress:
    """How far a running job is, reported by its task, and the claim it runs under."""

    id: int
    claim: int  # the claim number (Claim.number)
    worker: str
    progress: float
    note: str | None


# Fenced on the claim, so a run that lost its claim changes nothing.
SET_PROGRESS = Named(
    SetProgress,
    """
UPDATE @schema.jobs AS j
SET progress = :progress, progress_note = :note
FROM (SELECT :id::bigint AS id, :claim::integer AS claim) AS f
WHERE j.id = f.id AND @fence
RETURNING j.id
""",
    integer,
)


@dataclass(frozen=True, slots=True)
class ResultState:
    """What a waiter needs of a job: its status, and its error or stored result."""

    status: str
    last_error: str | None
    result: str | None  # JSON text, for a succeeded job whose task keeps results
    expired: bool
    uncommitted: bool  # written by the reading transaction, not committed: no worker sees it


# The live or kept job's state, or its stored result. `uncommitted`: the job row's version was
# written by this very transaction or one of its savepoints (released or not), which has not
# committed, so no worker can claim it while this transaction waits. Such a row's xmin comes at
# or after this transaction's top xid: `own` is that full xid, the 32-bit xmin placed after the
# top xid (within 2**31 of it, as live xids are). A row this snapshot sees whose writer is at
# or past the snapshot's xmax, or still in progress, can only be this transaction's own; the
# CASE asks txid_status only of an xid before xmax (never of one "in the future", which raises).
# A frozen row over 2**31 xids old may keep a raw xmin that passes: the flag only adds a hint.
RESULT_STATE = Statement(
    """
SELECT status, last_error, NULL::text AS result, false AS expired,
       CASE WHEN t.top IS NULL OR w.after >= 2147483648 THEN false
            WHEN t.top + w.after >= txid_snapshot_xmax(txid_current_snapshot()) THEN true
            ELSE coalesce(txid_status(t.top + w.after) = 'in progress', false)
       END AS uncommitted
FROM @schema.jobs AS j,
     LATERAL (SELECT txid_current_if_assigned() AS top) AS t,
     LATERAL (SELECT (j.xmin::text::bigint - t.top % 4294967296 + 4294967296) % 4294967296
              AS after) AS w
WHERE j.id = :id
UNION ALL
SELECT 'succeeded', NULL, result::text, expires_at <= now(), false FROM @schema.results
WHERE id = :id
LIMIT 1
""",
    columns(ResultState),
    ("id",),
)
