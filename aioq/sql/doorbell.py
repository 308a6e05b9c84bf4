"""The worker's side of the conditional doorbell. docs/architecture.md, "The doorbell".

A worker about to sleep holds a shared session advisory lock per served queue on its LISTEN
connection, keyed (the jobs table's oid, hashtext(queue)); an insert rings a queue only when its
exclusive try of that lock fails. The session holds the lock, so a worker that dies (its
connection closes) stops the ringing with it. Each inserting transaction holds (~oid,
hashtext(queue)) shared until it ends: an exclusive try of that key that fails means an insert
that may not have rung is still in flight.
"""

from __future__ import annotations

from aioq.sql import Statement, boolean, nothing

__all__ = ("ARM_DOORBELL", "DISARM_DOORBELL", "INSERTS_IN_FLIGHT")

# True if any queue's in-flight key is taken (an exclusive try fails), over rows with q.
_IN_FLIGHT = """
SELECT coalesce(bool_or(NOT (
    pg_try_advisory_lock(~'{s}.jobs'::regclass::oid::int, hashtext(q))
    AND pg_advisory_unlock(~'{s}.jobs'::regclass::oid::int, hashtext(q))
)), false)
"""

# $1: the queues. Takes each queue's doorbell lock, then (OFFSET 0 keeps the order: the outer
# test runs on each row the subquery made) tests its in-flight key; true if any was taken.
ARM_DOORBELL = Statement(
    _IN_FLIGHT
    + """FROM (
    SELECT q, pg_advisory_lock_shared('{s}.jobs'::regclass::oid::int, hashtext(q))
    FROM unnest($1::text[]) AS q OFFSET 0
) AS armed
""",
    boolean,
)

# The in-flight test alone, for a worker that holds its doorbell locks already.
INSERTS_IN_FLIGHT = Statement(_IN_FLIGHT + "FROM unnest($1::text[]) AS q\n", boolean)

DISARM_DOORBELL = Statement(
    """
SELECT pg_advisory_unlock_shared('{s}.jobs'::regclass::oid::int, hashtext(q))
FROM unnest($1::text[]) AS q
""",
    nothing,
)
