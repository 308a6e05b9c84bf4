"""The conditional doorbell, both sides. docs/architecture.md, "The doorbell".

Every key is 64 bits, ``hashtextextended(name, seed)``, the seeds from the jobs table's oid
(:data:`aioq.sql.fragments.DUTY`, ``STANDBY``); a name is a queue's, or the empty name, which no
queue has: the wildcard, "any queue". Two keys per name:

- duty ``hashtextextended(name, oid)``. One worker at a time is on duty for a name: it holds
  this key exclusively on its LISTEN connection while it sleeps. Every statement that makes a
  job of a queue claimable tries the queue's key *shared* for its transaction (``@rang``): when
  the try fails a worker is on duty and the statement NOTIFYs (at commit); when it succeeds,
  the statement holds the key until its transaction ends, "an insert in flight", and a worker
  cannot go on duty for the queue until it has committed (the arming worker then looks once
  more); it then tries the wildcard's key shared and releases it at once, and NOTIFYs when that
  fails. Inserters only ever take keys shared: they never wait on each other, and never ring
  each other.
- standby ``hashtextextended(name, ~oid)``. Every sleeping worker of the name holds it shared.
  A worker that finds another on duty sleeps on that one's watch (every ring reaches every
  LISTEN); the one on duty, when it leaves duty, rings the key on the hand-over channel if any
  other holds standby.

A worker arms its queues one by one up to :data:`aioq.doorbell.MAX_ARMED` of them, and the
wildcard beyond: its locks are bounded whatever the number of queues. Armed on the wildcard, it
probes its queues' keys for inserts in flight instead of holding them.

The session holds the worker's locks, so a worker that dies stops the ringing with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioq.sql import Statement, columns, nothing

__all__ = (
    "ARM_DOORBELL",
    "DISARM_DOORBELL",
    "RESET_DOORBELL",
    "RING",
    "Duty",
    "handover_channel",
)


def handover_channel(schema: str) -> str:
    """Return the schema's hand-over channel: a worker left duty for a name that others slept
    on, payload the name's duty key (decimal). Five characters of prefix, as the other
    channels (aioq.sql.channel_name)."""
    return f"aioq~{schema}"


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
    """What arming found for one name (a queue, or '' for the wildcard): on duty, or covered by
    another worker on duty (else an insert is in flight: look again). For a queue probed under
    the wildcard, ``covered`` says no insert into it is in flight."""

    queue: str
    key: int  # the name's duty key: hand-overs name it
    duty: bool
    covered: bool


# :standby the names to take standby for (not held yet), :duty the names to try duty for,
# :probe the queues to probe for inserts in flight (armed on the wildcard), :handover the
# hand-over channel. Standby is taken first (the CTE scanned as the outer side of the lateral
# join), then per name: duty (exclusive, never waits); if that failed, a shared try tells
# another worker on duty (it fails) from inserts in flight (it succeeds: taken and released at
# once). Then each probed queue's key is tried exclusively and released at once: it fails while
# an insert into the queue is in flight (a shared try then succeeds) or a worker is on duty for
# it. A worker that tried that key while the probe held it took the probe for a worker on duty
# and sleeps on its watch: it holds the queue's standby, and the probe, once released, rings it
# on the hand-over channel.
ARM_DOORBELL = Statement(
    """
WITH standby AS MATERIALIZED (
    SELECT count(pg_advisory_lock_shared(hashtextextended(s, @standby))) AS n
    FROM unnest(:standby::text[]) AS s
), tried AS MATERIALIZED (
    SELECT t.queue, t.key, t.duty,
           CASE WHEN t.duty THEN true
                ELSE NOT (pg_try_advisory_lock_shared(t.key)
                          AND pg_advisory_unlock_shared(t.key)) END AS covered
    FROM standby, LATERAL (
        SELECT k.q, k.key, pg_try_advisory_lock(k.key)
        FROM (SELECT q, hashtextextended(q, @duty) FROM unnest(:duty::text[]) AS q) AS k(q, key)
        WHERE standby.n >= 0 OFFSET 0
    ) AS t(queue, key, duty)
)
SELECT queue, key, duty, covered FROM tried
UNION ALL
SELECT p.queue, p.key, false,
       CASE WHEN NOT pg_try_advisory_lock(p.key)
                THEN NOT (pg_try_advisory_lock_shared(p.key) AND pg_advisory_unlock_shared(p.key))
            WHEN NOT pg_advisory_unlock(p.key) THEN true  -- never: it was just taken
            WHEN pg_try_advisory_lock(hashtextextended(p.queue, @standby))
                THEN pg_advisory_unlock(hashtextextended(p.queue, @standby))
            ELSE (SELECT true FROM pg_notify(:handover, p.key::text)) END
FROM (SELECT count(*) AS n FROM tried) AS done, LATERAL (
    SELECT q, hashtextextended(q, @duty) FROM unnest(:probe::text[]) AS q
    WHERE done.n >= 0 OFFSET 0
) AS p(queue, key)
""",
    columns(Duty),
    ("standby", "duty", "probe", "handover"),
)

# :standby the names whose standby this session holds, :duty those it is on duty for,
# :handover the hand-over channel. Leaves duty and standby, then rings (on the hand-over
# channel, the name's duty key) each name it was on duty for that another worker holds
# standby for: they slept on its watch. The LISTEN connection ignores its own notifications.
DISARM_DOORBELL = Statement(
    """
WITH unlocked AS MATERIALIZED (
    SELECT count(pg_advisory_unlock(hashtextextended(q, @duty))) AS n
    FROM unnest(:duty::text[]) AS q
), resting AS MATERIALIZED (
    SELECT count(pg_advisory_unlock_shared(hashtextextended(s, @standby))) AS n
    FROM unnest(:standby::text[]) AS s
)
SELECT pg_notify(:handover, hashtextextended(t.q, @duty)::text)
FROM unlocked, resting, LATERAL (
    SELECT q FROM unnest(:duty::text[]) AS q WHERE unlocked.n + resting.n >= 0 OFFSET 0
) AS t
WHERE NOT (pg_try_advisory_lock(hashtextextended(t.q, @standby))
           AND pg_advisory_unlock(hashtextextended(t.q, @standby)))
""",
    nothing,
    ("duty", "standby", "handover"),
)

# After an arm that failed midway (out of shared memory, a timeout): the session holds locks
# nobody knows of. Releases every advisory lock of the session (it holds no others), then rings
# on the hand-over channel each of :duty (the names it was or may have gone on duty for) that
# another worker holds standby for.
RESET_DOORBELL = Statement(
    """
WITH released AS MATERIALIZED (
    SELECT count(*) AS n FROM (SELECT pg_advisory_unlock_all()) AS a
)
SELECT pg_notify(:handover, hashtextextended(t.q, @duty)::text)
FROM released, LATERAL (
    SELECT q FROM unnest(:duty::text[]) AS q WHERE released.n >= 0 OFFSET 0
) AS t
WHERE NOT (pg_try_advisory_lock(hashtextextended(t.q, @standby))
           AND pg_advisory_unlock(hashtextextended(t.q, @standby)))
""",
    nothing,
    ("duty", "handover"),
)
