"""Fleet-wide queue limits and pauses, enforced inside the claim. docs/architecture.md, "Limits".

A limited queue's claim runs in a transaction of its own: LOCK_QUEUE takes the queue's turn
(its row lock), then CLAIM_LIMITED counts what the queue has room for in a fresh snapshot and
claims no more. Queues without limits are claimed by aioq.sql.jobs' plain claim.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.db import Row
from aioq.job import Claim
from aioq.sql import Named, Statement, columns, text
from aioq.sql.jobs import ClaimJobs

__all__ = (
    "CLAIM_LIMITED",
    "LIMITED_QUEUES",
    "LOCK_QUEUE",
    "QUEUE_SETTINGS",
    "SET_QUEUE",
    "LimitedQueue",
    "QueueSettings",
    "SetQueue",
)


@dataclass(frozen=True, slots=True)
class LimitedQueue:
    """A queue with a limit or paused, and its rate period in seconds (None: no rate)."""

    name: str
    rate_period: float | None


# Which of a worker's queues go through the limited claim; read about once a second.
LIMITED_QUEUES = Statement(
    """
SELECT name, extract(epoch FROM rate_period)::float8 AS rate_period
FROM @schema.queues WHERE name = ANY(:queues::text[]) AND @queue_limited
""",
    columns(LimitedQueue),
    ("queues",),
)


def _limited(row: Row) -> bool:
    return bool(row[0])


# The first statement of a limited claim's transaction: take the queue's turn. Whoever held it
# before has committed once this returns, so the next statement (a new snapshot) sees its
# claims. No row: the queue has no settings.
LOCK_QUEUE = Statement(
    """
SELECT @queue_limited AS limited FROM @schema.queues WHERE name = :queue FOR NO KEY UPDATE
""",
    _limited,
    ("queue",),
)


def _limited_claim(row: Row) -> tuple[Claim | None, int | None, int | None]:
    return (None if row["id"] is None else Claim.from_row(row)), row["rate_room"], row["room"]


# The claim of a limited queue, run right after LOCK_QUEUE in the same transaction: as many
# jobs as the queue has room for (none while paused; max_running minus its running jobs; the
# rate's limit minus the claims counted in the last period), then the claims are counted in the
# current slot and slots past the period are dropped. :queue, :limit wanted, :worker.
# One row per job claimed, or one row with a NULL id when none was; rate_room on every row
# is what the rate allowed (NULL: no rate), for the worker to know the rate held it back, and
# room what max_running, the rate and a pause allowed (NULL: neither limit): a claim that took
# it all leaves the queue at its limit, and the worker does not arm its doorbell.
# Claim times are clock_timestamp() (not the transaction's start): the turns are serialized,
# so each claim's time is after the claims it counted.
#
# The pick of a queue with max_running_per_key (docs/architecture.md, "Per-key concurrency")
# reads nothing unless the queue has one (`plain` then reads nothing instead). `keys` walks the
# distinct keys of the queue's pending jobs, one index probe each (a skip scan of
# jobs_key_claim_idx); per key, the first jobs in claim order up to the key's room
# (max_running_per_key less its running jobs, counted in jobs_key_running_idx); `turn` numbers
# them within their key, so that at equal priority the claim takes one job of every key before
# a second of any (round robin). Jobs without a key form one more group, looked for only when
# fewer keys than the claim takes have jobs ready (so that the group gets a turn), and among the
# queue's first 100 ready jobs only (a heap read each: 1000 of them cost 15 ms a claim): a queue
# of keyed jobs never scans its backlog for an unkeyed one.
CLAIM_LIMITED = Named(
    ClaimJobs,
    """
WITH RECURSIVE counted_room AS MATERIALIZED (
    SELECT t.now, q.rate_limit, q.rate_period, q.paused, q.max_running_per_key AS per_key,
           extract(epoch FROM q.rate_period) / 10 AS slot_s,
           CASE WHEN q.max_running IS NOT NULL THEN q.max_running - (
               SELECT count(*) FROM @schema.jobs WHERE queue = :queue AND status = 'running') END
               AS running_room,
           CASE WHEN q.rate_limit IS NOT NULL THEN q.rate_limit - (
               SELECT coalesce(sum(c.claims), 0) FROM @schema.queue_claims AS c
               WHERE c.queue = :queue AND c.slot_end > t.now - q.rate_period) END AS rate_room
    FROM @schema.queues AS q, (SELECT clock_timestamp() AS now) AS t
    WHERE q.name = :queue
),
room AS MATERIALIZED (
    SELECT r.*,
           CASE WHEN r.paused THEN 0 ELSE greatest(0, least(:limit, r.running_room, r.rate_room))
           END AS n
    FROM counted_room AS r
),
plain AS (
    SELECT id FROM @schema.jobs
    WHERE queue = :queue AND @ready AND @known
      AND (SELECT per_key FROM room) IS NULL
    ORDER BY @claim_order
    LIMIT (SELECT n FROM room)
    FOR UPDATE SKIP LOCKED
),
keys AS (
    (SELECT concurrency_key AS k FROM @schema.jobs
     WHERE status = 'pending' AND queue = :queue AND concurrency_key IS NOT NULL
       AND (SELECT per_key FROM room) IS NOT NULL
     ORDER BY concurrency_key
     LIMIT 1)
    UNION ALL
    SELECT (SELECT j.concurrency_key FROM @schema.jobs AS j
            WHERE j.status = 'pending' AND j.queue = :queue AND j.concurrency_key > keys.k
            ORDER BY j.concurrency_key
            LIMIT 1)
    FROM keys WHERE keys.k IS NOT NULL
),
per_key AS (
    SELECT p.id, p.priority, p.run_at,
           row_number() OVER (PARTITION BY keys.k ORDER BY @claim_order) AS turn
    FROM keys
    CROSS JOIN LATERAL (
        SELECT id, priority, run_at FROM @schema.jobs
        WHERE queue = :queue AND concurrency_key = keys.k AND @ready AND @known
        ORDER BY @claim_order
        LIMIT greatest(0, least((SELECT n FROM room), (SELECT per_key FROM room) - (
            SELECT count(*) FROM @schema.jobs AS r
            WHERE r.queue = :queue AND r.concurrency_key = keys.k AND r.status = 'running')))
        FOR UPDATE SKIP LOCKED
    ) AS p
    WHERE keys.k IS NOT NULL
),
unkeyed AS (
    SELECT j.id, j.priority, j.run_at FROM @schema.jobs AS j
    WHERE j.id = ANY(ARRAY(
            SELECT id FROM @schema.jobs
            WHERE queue = :queue AND @ready AND @known
              AND (SELECT per_key FROM room) IS NOT NULL
              AND (SELECT count(*) FROM per_key WHERE turn = 1) < (SELECT n FROM room)
            ORDER BY @claim_order
            LIMIT 100))
      AND j.concurrency_key IS NULL AND j.status = 'pending'
    ORDER BY @claim_order
    LIMIT (SELECT n FROM room)
    FOR UPDATE SKIP LOCKED
),
keyed AS (
    SELECT id, priority, run_at, turn FROM per_key
    UNION ALL
    SELECT id, priority, run_at, row_number() OVER (ORDER BY @claim_order)
    FROM unkeyed
),
picked AS (
    SELECT id FROM plain
    UNION ALL
    (SELECT id FROM keyed ORDER BY priority DESC, turn, run_at, id LIMIT (SELECT n FROM room))
),
claimed AS (
    UPDATE @schema.jobs AS j
    SET @claim,
        locked_at = (SELECT now FROM room), lease_expires_at = (SELECT now FROM room) + j.lease
    WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING @claimed_columns
),
counted AS (
    INSERT INTO @schema.queue_claims AS c (queue, slot_start, slot_end, claims)
    SELECT :queue, s.start, s.start + make_interval(secs => r.slot_s), n.claimed
    FROM room AS r
    CROSS JOIN LATERAL (
        SELECT to_timestamp(floor(extract(epoch FROM r.now) / r.slot_s) * r.slot_s) AS start
    ) AS s
    CROSS JOIN (SELECT count(*) AS claimed FROM claimed) AS n
    WHERE r.rate_limit IS NOT NULL AND n.claimed > 0
    ON CONFLICT (queue, slot_start) DO UPDATE
    SET claims = c.claims + EXCLUDED.claims, slot_end = greatest(c.slot_end, EXCLUDED.slot_end)
),
pruned AS (
    DELETE FROM @schema.queue_claims AS c
    USING room AS r
    WHERE c.queue = :queue AND c.slot_end <= r.now - coalesce(r.rate_period, interval '0')
)
SELECT c.*, r.rate_room,
       CASE WHEN r.paused THEN 0 ELSE greatest(0, least(r.running_room, r.rate_room)) END AS room
FROM room AS r LEFT JOIN claimed AS c ON true
""",
    _limited_claim,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SetQueue:
    """A queue's settings to change: each ``set_*`` says whether to set its value (the others
    keep theirs)."""

    queue: str
    set_max_running: bool
    max_running: int | None
    set_rate: bool
    rate_limit: int | None  # claims per rate_period seconds
    rate_period: float | None
    set_paused: bool
    paused: bool
    must_exist: bool  # refuse a queue with neither settings nor live jobs (a typo in a pause)
    doorbell: str  # the doorbell channel
    set_max_running_per_key: bool
    max_running_per_key: int | None


# Upsert a queue's settings. Notifies the workers that limits changed (aioq.sql.LIMITS_CHANGED:
# they read them again), then rings the queue's doorbell, so a resume (or a raised limit) is
# claimed at once.
SET_QUEUE = Named(
    SetQueue,
    """
WITH changed AS (
    INSERT INTO @schema.queues AS q
        (name, max_running, rate_limit, rate_period, paused, max_running_per_key)
    SELECT :queue, CASE WHEN :set_max_running THEN :max_running::integer END,
           CASE WHEN :set_rate THEN :rate_limit::integer END,
           CASE WHEN :set_rate THEN make_interval(secs => :rate_period::float8) END,
           :set_paused AND :paused,
           CASE WHEN :set_max_running_per_key THEN :max_running_per_key::integer END
    WHERE NOT :must_exist
       OR EXISTS (SELECT FROM @schema.queues WHERE name = :queue)
       OR EXISTS (SELECT FROM @schema.jobs WHERE queue = :queue AND status = 'pending')
       OR EXISTS (SELECT FROM @schema.jobs WHERE queue = :queue AND status = 'running')
    ON CONFLICT (name) DO UPDATE
    SET max_running = CASE WHEN :set_max_running THEN EXCLUDED.max_running ELSE q.max_running END,
        rate_limit = CASE WHEN :set_rate THEN EXCLUDED.rate_limit ELSE q.rate_limit END,
        rate_period = CASE WHEN :set_rate THEN EXCLUDED.rate_period ELSE q.rate_period END,
        paused = CASE WHEN :set_paused THEN EXCLUDED.paused ELSE q.paused END,
        max_running_per_key = CASE WHEN :set_max_running_per_key
                              THEN EXCLUDED.max_running_per_key
                              ELSE q.max_running_per_key END,
        updated_at = now()
    RETURNING q.name
),
rang AS (
    SELECT pg_notify(:doorbell, ''), pg_notify(:doorbell, name) FROM changed
)
SELECT name FROM changed WHERE (SELECT count(*) FROM rang) >= 0
""",
    text,
)


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """A queue's stored settings, with the claims counted in its rate window now."""

    name: str
    max_running: int | None
    rate_limit: int | None
    rate_period: float | None
    paused: bool
    updated_at: datetime
    window_claims: int | None
    max_running_per_key: int | None


QUEUE_SETTINGS = Statement(
    """
SELECT q.name, q.max_running, q.rate_limit,
       extract(epoch FROM q.rate_period)::float8 AS rate_period, q.paused, q.updated_at,
       CASE WHEN q.rate_limit IS NOT NULL THEN (
           SELECT coalesce(sum(c.claims), 0)::integer FROM @schema.queue_claims AS c
           WHERE c.queue = q.name AND c.slot_end > clock_timestamp() - q.rate_period) END
           AS window_claims,
       q.max_running_per_key
FROM @schema.queues AS q
ORDER BY q.name
""",
    columns(QueueSettings),
)
