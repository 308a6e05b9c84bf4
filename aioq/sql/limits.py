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
from aioq.sql import Statement, columns, text
from aioq.sql.jobs import claim_set

__all__ = (
    "CLAIM_LIMITED",
    "LIMITED_QUEUES",
    "LOCK_QUEUE",
    "QUEUE_SETTINGS",
    "SET_QUEUE",
    "LimitedQueue",
    "QueueSettings",
)

_LIMITED = (
    "(max_running IS NOT NULL OR rate_limit IS NOT NULL OR paused"
    " OR max_running_per_key IS NOT NULL)"
)


@dataclass(frozen=True, slots=True)
class LimitedQueue:
    """A queue with a limit or paused, and its rate period in seconds (None: no rate)."""

    name: str
    rate_period: float | None


# Which of a worker's queues ($1) go through the limited claim; read about once a second.
LIMITED_QUEUES = Statement(
    f"""
SELECT name, extract(epoch FROM rate_period)::float8 AS rate_period
FROM {{s}}.queues WHERE name = ANY($1::text[]) AND {_LIMITED}
""",
    columns(LimitedQueue),
)


def _limited(row: Row) -> bool:
    return bool(row[0])


# The first statement of a limited claim's transaction: take queue $1's turn. Whoever held it
# before has committed once this returns, so the next statement (a new snapshot) sees its
# claims. No row: the queue has no settings.
LOCK_QUEUE = Statement(
    f"""
SELECT {_LIMITED} AS limited FROM {{s}}.queues WHERE name = $1 FOR NO KEY UPDATE
""",
    _limited,
)


# The pick of a queue with max_running_per_key (docs/architecture.md, "Per-key concurrency"),
# a part of CLAIM_LIMITED that reads nothing unless the queue has one (`plain` then reads
# nothing instead). `keys` walks the distinct keys of the queue's pending jobs, one index probe
# each (a skip scan of jobs_key_claim_idx); per key, the first jobs in claim order up to the
# key's room (max_running_per_key less its running jobs, counted in jobs_key_running_idx);
# `turn` numbers them within their key, so that at equal priority the claim takes one job of
# every key before a second of any (round robin). Jobs without a key form one more group,
# looked for only when fewer keys than the claim takes have jobs ready (so that the group gets
# a turn), and among the queue's first 100 ready jobs only (a heap read each: 1000 of them cost
# 15 ms a claim): a queue of keyed jobs never scans its backlog for an unkeyed one.
KEYED_PICK = """
keys AS (
    (SELECT concurrency_key AS k FROM {s}.jobs
     WHERE status = 'pending' AND queue = $1 AND concurrency_key IS NOT NULL
       AND (SELECT per_key FROM room) IS NOT NULL
     ORDER BY concurrency_key
     LIMIT 1)
    UNION ALL
    SELECT (SELECT j.concurrency_key FROM {s}.jobs AS j
            WHERE j.status = 'pending' AND j.queue = $1 AND j.concurrency_key > keys.k
            ORDER BY j.concurrency_key
            LIMIT 1)
    FROM keys WHERE keys.k IS NOT NULL
),
per_key AS (
    SELECT p.id, p.priority, p.run_at,
           row_number() OVER (PARTITION BY keys.k ORDER BY p.priority DESC, p.run_at, p.id)
               AS turn
    FROM keys
    CROSS JOIN LATERAL (
        SELECT j.id, j.priority, j.run_at FROM {s}.jobs AS j
        WHERE j.status = 'pending' AND j.queue = $1 AND j.concurrency_key = keys.k
          AND j.run_at <= now()
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT greatest(0, least((SELECT n FROM room), (SELECT per_key FROM room) - (
            SELECT count(*) FROM {s}.jobs AS r
            WHERE r.queue = $1 AND r.concurrency_key = keys.k AND r.status = 'running')))
        FOR UPDATE SKIP LOCKED
    ) AS p
    WHERE keys.k IS NOT NULL
),
unkeyed AS (
    SELECT j.id, j.priority, j.run_at FROM {s}.jobs AS j
    WHERE j.id = ANY(ARRAY(
            SELECT h.id FROM {s}.jobs AS h
            WHERE h.status = 'pending' AND h.queue = $1 AND h.run_at <= now()
              AND (SELECT per_key FROM room) IS NOT NULL
              AND (SELECT count(*) FROM per_key WHERE turn = 1) < (SELECT n FROM room)
            ORDER BY h.priority DESC, h.run_at, h.id
            LIMIT 100))
      AND j.concurrency_key IS NULL AND j.status = 'pending'
    ORDER BY j.priority DESC, j.run_at, j.id
    LIMIT (SELECT n FROM room)
    FOR UPDATE SKIP LOCKED
),
keyed AS (
    SELECT id, priority, run_at, turn FROM per_key
    UNION ALL
    SELECT id, priority, run_at, row_number() OVER (ORDER BY priority DESC, run_at, id)
    FROM unkeyed
)"""


def _limited_claim(row: Row) -> tuple[Claim | None, int | None, int | None]:
    return (None if row["id"] is None else Claim.from_row(row)), row["rate_room"], row["room"]


# The claim of a limited queue, run right after LOCK_QUEUE in the same transaction: as many
# jobs as the queue has room for (none while paused; max_running minus its running jobs; the
# rate's limit minus the claims counted in the last period), then the claims are counted in the
# current slot and slots past the period are dropped. $1 queue, $2 wanted, $3 worker id.
# One row per job claimed, or one row with a NULL id when none was; rate_room on every row
# is what the rate allowed (NULL: no rate), for the worker to know the rate held it back, and
# room what max_running, the rate and a pause allowed (NULL: neither limit): a claim that took
# it all leaves the queue at its limit, and the worker does not arm its doorbell.
# Claim times are clock_timestamp() (not the transaction's start): the turns are serialized,
# so each claim's time is after the claims it counted.
CLAIM_LIMITED = Statement(
    """
WITH RECURSIVE counted_room AS MATERIALIZED (
    SELECT t.now, q.rate_limit, q.rate_period, q.paused, q.max_running_per_key AS per_key,
           extract(epoch FROM q.rate_period) / 10 AS slot_s,
           CASE WHEN q.max_running IS NOT NULL THEN q.max_running - (
               SELECT count(*) FROM {s}.jobs WHERE queue = $1 AND status = 'running') END
               AS running_room,
           CASE WHEN q.rate_limit IS NOT NULL THEN q.rate_limit - (
               SELECT coalesce(sum(c.claims), 0) FROM {s}.queue_claims AS c
               WHERE c.queue = $1 AND c.slot_end > t.now - q.rate_period) END AS rate_room
    FROM {s}.queues AS q, (SELECT clock_timestamp() AS now) AS t
    WHERE q.name = $1
),
room AS MATERIALIZED (
    SELECT r.*,
           CASE WHEN r.paused THEN 0 ELSE greatest(0, least($2, r.running_room, r.rate_room)) END
               AS n
    FROM counted_room AS r
),
plain AS (
    SELECT id FROM {s}.jobs
    WHERE status = 'pending' AND queue = $1 AND run_at <= now()
      AND (SELECT per_key FROM room) IS NULL
    ORDER BY priority DESC, run_at, id
    LIMIT (SELECT n FROM room)
    FOR UPDATE SKIP LOCKED
),"""
    + KEYED_PICK
    + """,
picked AS (
    SELECT id FROM plain
    UNION ALL
    (SELECT id FROM keyed ORDER BY priority DESC, turn, run_at, id LIMIT (SELECT n FROM room))
),
claimed AS ("""
    + claim_set("(SELECT now FROM room)")
    + """),
counted AS (
    INSERT INTO {s}.queue_claims AS c (queue, slot_start, slot_end, claims)
    SELECT $1, s.start, s.start + make_interval(secs => r.slot_s), n.claimed
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
    DELETE FROM {s}.queue_claims AS c
    USING room AS r
    WHERE c.queue = $1 AND c.slot_end <= r.now - coalesce(r.rate_period, interval '0')
)
SELECT c.*, r.rate_room,
       CASE WHEN r.paused THEN 0 ELSE greatest(0, least(r.running_room, r.rate_room)) END AS room
FROM room AS r LEFT JOIN claimed AS c ON true
""",
    _limited_claim,
)

# Upsert queue $1's settings: $2/$4/$7 say which of max_running ($3), the rate ($5 claims per
# $6 seconds) and paused ($8) to set; the others keep their value. With $9, a queue that has
# neither settings nor live jobs is refused (a typo in a pause); $11 says whether to set
# max_running_per_key ($12). Notifies the workers that
# limits changed (aioq.sql.LIMITS_CHANGED: they read them again), then rings the queue's
# doorbell, so a resume (or a raised limit) is claimed at once. $10 the doorbell channel.
SET_QUEUE = Statement(
    """
WITH changed AS (
    INSERT INTO {s}.queues AS q
        (name, max_running, rate_limit, rate_period, paused, max_running_per_key)
    SELECT $1, CASE WHEN $2 THEN $3::integer END, CASE WHEN $4 THEN $5::integer END,
           CASE WHEN $4 THEN make_interval(secs => $6::float8) END, $7 AND $8,
           CASE WHEN $11 THEN $12::integer END
    WHERE NOT $9
       OR EXISTS (SELECT FROM {s}.queues WHERE name = $1)
       OR EXISTS (SELECT FROM {s}.jobs WHERE queue = $1 AND status = 'pending')
       OR EXISTS (SELECT FROM {s}.jobs WHERE queue = $1 AND status = 'running')
    ON CONFLICT (name) DO UPDATE
    SET max_running = CASE WHEN $2 THEN EXCLUDED.max_running ELSE q.max_running END,
        rate_limit = CASE WHEN $4 THEN EXCLUDED.rate_limit ELSE q.rate_limit END,
        rate_period = CASE WHEN $4 THEN EXCLUDED.rate_period ELSE q.rate_period END,
        paused = CASE WHEN $7 THEN EXCLUDED.paused ELSE q.paused END,
        max_running_per_key = CASE WHEN $11 THEN EXCLUDED.max_running_per_key
                              ELSE q.max_running_per_key END,
        updated_at = now()
    RETURNING q.name
),
rang AS (
    SELECT pg_notify($10, ''), pg_notify($10, name) FROM changed
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
           SELECT coalesce(sum(c.claims), 0)::integer FROM {s}.queue_claims AS c
           WHERE c.queue = q.name AND c.slot_end > clock_timestamp() - q.rate_period) END
           AS window_claims,
       q.max_running_per_key
FROM {s}.queues AS q
ORDER BY q.name
""",
    columns(QueueSettings),
)
