"""The conditional doorbell, both sides. docs/architecture.md, "The doorbell".

Two advisory lock keys per queue, from the jobs table's oid and hashtext(queue):

- duty ``(oid, hashtext(queue))``. One worker at a time is on duty for a queue: it holds this
  key exclusively on its LISTEN connection while it sleeps. Every statement that makes a job of
  the queue claimable tries this key *shared* for its transaction (``@rang``): when the try
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

__all__ = ("ARM_DOORBELL", "DISARM_DOORBELL", "RING", "Duty")

# A queue whose jobs were inserted with raw SQL: aioq.admin.ring(). Holds the queue's duty key
# shared until the transaction ends, as aioq's own inserts do.
RING = Statement(
    """
WITH ready_queues(queue) AS (SELECT :queue::text),
@rang
SELECT count(*) FROM rang
""",
    nothing,
    ("queue",),
)


@dataclass(frozen=True, slots=True)
class Duty:
    """What arming found for one queue: on duty, or covered by another worker on duty (else
    an insert is in flight: look again)."""

    queue: str
    duty: bool
    covered: bool


# :standby the queues to take standby for (not held yet), :duty the queues to try duty for.
# Standby is taken first (the CTE scanned as the outer side of the lateral join), then per
# queue: duty (exclusive, never waits); if that failed, a shared try tells another worker on
# duty (it fails) from inserts in flight (it succeeds: taken and released at once).
ARM_DOORBELL = Statement(
    """
WITH standby AS MATERIALIZED (
    SELECT count(pg_advisory_lock_shared(@standby, hashtext(s))) AS n
    FROM unnest(:standby::text[]) AS s
)
SELECT t.queue, t.duty,
       CASE WHEN t.duty THEN true
            ELSE NOT (pg_try_advisory_lock_shared(@duty, hashtext(t.queue))
                      AND pg_advisory_unlock_shared(@duty, hashtext(t.queue))) END AS covered
FROM standby, LATERAL (
    SELECT q, pg_try_advisory_lock(@duty, hashtext(q)) FROM unnest(:duty::text[]) AS q
    WHERE standby.n >= 0 OFFSET 0
) AS t(queue, duty)
""",
    columns(Duty),
    ("standby", "duty"),
)

# :standby the queues whose standby this session holds, :duty those it is on duty for. Leaves
# duty and standby, then rings each queue it was on duty for that another worker holds standby
# for (they slept on its watch). The ring comes from the LISTEN connection itself, which
# ignores its own notifications.
DISARM_DOORBELL = Statement(
    """
WITH unlocked AS MATERIALIZED (
    SELECT count(pg_advisory_unlock(@duty, hashtext(q))) AS n FROM unnest(:duty::text[]) AS q
), resting AS MATERIALIZED (
    SELECT count(pg_advisory_unlock_shared(@standby, hashtext(s))) AS n
    FROM unnest(:standby::text[]) AS s
)
SELECT pg_notify(@doorbell, t.q)
FROM unlocked, resting, LATERAL (
    SELECT q FROM unnest(:duty::text[]) AS q WHERE unlocked.n + resting.n >= 0 OFFSET 0
) AS t
WHERE NOT (pg_try_advisory_lock(@standby, hashtext(t.q))
           AND pg_advisory_unlock(@standby, hashtext(t.q)))
""",
    nothing,
    ("standby", "duty"),
)
