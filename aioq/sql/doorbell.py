"""The conditional doorbell, both sides. docs/architecture.md, "The doorbell".

Two advisory lock keys per queue, from the jobs table's oid and hashtext(queue):

- duty ``(oid, hashtext(queue))``. One worker at a time is on duty for a queue: it holds this
  key exclusively on its LISTEN connection while it sleeps. Every statement that makes a job of
  the queue claimable tries this key *shared* for its transaction (:func:`ring`): when the try
  fails a worker is on duty and the statement NOTIFYs (at commit); when it succeeds, the
  statement holds the key until its transaction ends, "an insert in flight", and a worker
  cannot go on duty until it has committed (the arming worker then looks once more). Inserters
  only ever take the key shared: they never wait on each other, and never ring each other.
- standby ``(~oid, hashtext(queue))``. Every sleeping worker of the queue holds it shared. A
  worker that finds another on duty sleeps on that one's watch (every ring reaches every
  LISTEN); the one on duty, when it leaves duty, rings the queue if any other holds standby.

The session holds the worker's locks, so a worker that dies stops the ringing with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioq.sql import Statement, columns, nothing

__all__ = ("ARM_DOORBELL", "DISARM_DOORBELL", "RING", "Duty", "ring", "rings")

DUTY = "'{s}.jobs'::regclass::oid::int"
STANDBY = "~'{s}.jobs'::regclass::oid::int"


def rings(queue: str) -> str:
    """A condition on ``queue`` (an SQL expression of a queue name): true when a worker is on
    duty for it. Testing it holds the queue's duty key shared until the transaction ends (the
    insert in flight), so the condition must be tested only for jobs that are claimable now."""
    return f"NOT pg_try_advisory_xact_lock_shared({DUTY}, hashtext({queue}))"


def ring(queues: str) -> str:
    """The ``rang`` CTE of a statement that makes jobs claimable: a NOTIFY (sent at commit) for
    each queue of ``queues`` (a query whose one column is the distinct names of the queues
    whose jobs are claimable now) that a worker is on duty for. The statement must read the
    CTE (``WHERE (SELECT count(*) FROM rang) >= 0``): PostgreSQL runs a CTE that is not
    data-modifying only if the statement reads it. OFFSET 0 keeps ``queues``' own conditions
    (claimable now) before the test."""
    return f"""rang AS (
    SELECT pg_notify({{channel}}, r.queue) FROM ({queues} OFFSET 0) AS r(queue)
    WHERE {rings("r.queue")}
)"""


# $1 a queue whose jobs were inserted with raw SQL: aioq.admin.ring(). Holds the queue's duty key
# shared until the transaction ends, as aioq's own inserts do.
RING = Statement(
    f"""
WITH {ring("SELECT $1::text")}
SELECT count(*) FROM rang
""",
    nothing,
)


@dataclass(frozen=True, slots=True)
class Duty:
    """What arming found for one queue: on duty, or covered by another worker on duty (else
    an insert is in flight: look again)."""

    queue: str
    duty: bool
    covered: bool


# $1 the queues to take standby for (not held yet), $2 the queues to try duty for. Standby is
# taken first (the CTE scanned as the outer side of the lateral join), then per queue: duty
# (exclusive, never waits); if that failed, a shared try tells another worker on duty (it
# fails) from inserts in flight (it succeeds: taken and released at once).
ARM_DOORBELL = Statement(
    f"""
WITH standby AS MATERIALIZED (
    SELECT count(pg_advisory_lock_shared({STANDBY}, hashtext(s))) AS n FROM unnest($1::text[]) AS s
)
SELECT t.queue, t.duty,
       CASE WHEN t.duty THEN true
            ELSE NOT (pg_try_advisory_lock_shared({DUTY}, hashtext(t.queue))
                      AND pg_advisory_unlock_shared({DUTY}, hashtext(t.queue))) END AS covered
FROM standby, LATERAL (
    SELECT q, pg_try_advisory_lock({DUTY}, hashtext(q)) FROM unnest($2::text[]) AS q
    WHERE standby.n >= 0 OFFSET 0
) AS t(queue, duty)
""",
    columns(Duty),
)

# $1 the queues whose standby this session holds, $2 those it is on duty for. Leaves duty and
# standby, then rings each queue it was on duty for that another worker holds standby for
# (they slept on its watch). The ring comes from the LISTEN connection itself, which ignores
# its own notifications.
DISARM_DOORBELL = Statement(
    f"""
WITH released AS MATERIALIZED (
    SELECT count(pg_advisory_unlock({DUTY}, hashtext(q))) AS n FROM unnest($2::text[]) AS q
), resting AS MATERIALIZED (
    SELECT count(pg_advisory_unlock_shared({STANDBY}, hashtext(s))) AS n
    FROM unnest($1::text[]) AS s
)
SELECT pg_notify({{channel}}, t.q)
FROM released, resting, LATERAL (
    SELECT q FROM unnest($2::text[]) AS q WHERE released.n + resting.n >= 0 OFFSET 0
) AS t
WHERE NOT (pg_try_advisory_lock({STANDBY}, hashtext(t.q))
           AND pg_advisory_unlock({STANDBY}, hashtext(t.q)))
""",
    nothing,
)
