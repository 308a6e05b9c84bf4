"""Periodic jobs: the scheduler's statements. docs/architecture.md, "Periodic ticks"."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.sql import Statement, columns, integer, text
from aioq.sql.doorbell import ring

__all__ = (
    "LIST_SCHEDULES",
    "SCHEDULE_START",
    "SCHEDULE_STATE",
    "SCHEDULE_TICK",
    "ScheduleRow",
    "ScheduleState",
)


@dataclass(frozen=True, slots=True)
class ScheduleState:
    """The database's clock, and the last tick enqueued of a schedule (None: never seen)."""

    now: datetime
    name: str
    last_tick: datetime | None


# $1 schedule names. The database's clock comes with the rows: ticks are judged by it.
SCHEDULE_STATE = Statement(
    """
SELECT clock_timestamp() AS now, n.name, s.last_tick
FROM unnest($1::text[]) AS n(name)
LEFT JOIN {s}.schedules AS s ON s.name = n.name
""",
    columns(ScheduleState),
)

# First sight of a schedule ($1 name, $2 task, $3 queue, $4 spec, $5 last tick, $6 next tick):
# record its latest past tick as done (not ticked: nothing was enqueued for it), so its first
# job is the next tick. A worker that finds
# the row already there changes nothing (no row comes back).
SCHEDULE_START = Statement(
    """
INSERT INTO {s}.schedules (name, task, queue, spec, last_tick, next_tick, ticked)
VALUES ($1, $2, $3, $4, $5, $6, false)
ON CONFLICT (name) DO NOTHING
RETURNING name
""",
    text,
)

# Enqueue ticks $5 (ascending) of schedule $1 once: the UPDATE advances last_tick only while it
# is older than the first of them, and the jobs are inserted only if it did. Two workers racing:
# the second waits for the first's row lock, re-reads the row it committed, and matches nothing.
# A late worker whose tick already ran (its job deleted) matches nothing either. $6 the next
# tick, $7 the job's arguments (JSON text), $8 priority, $9 max_attempts, $10 lease seconds.
SCHEDULE_TICK = Statement(
    f"""
WITH advanced AS (
    UPDATE {{s}}.schedules
    SET task = $2, queue = $3, spec = $4,
        last_tick = ($5::timestamptz[])[cardinality($5::timestamptz[])], next_tick = $6,
        ticked = true, updated_at = now()
    WHERE name = $1 AND last_tick < ($5::timestamptz[])[1]
    RETURNING name
),
{ring("SELECT $3::text WHERE EXISTS (SELECT FROM advanced) AND ($5::timestamptz[])[1] <= now()")}
INSERT INTO {{s}}.jobs (queue, task, args, priority, run_at, max_attempts, lease, scheduled_at)
SELECT $3, $2, $7::text::jsonb, $8, t.tick, $9, make_interval(secs => $10::float8), t.tick
FROM unnest($5::timestamptz[]) WITH ORDINALITY AS t(tick, n)
WHERE EXISTS (SELECT FROM advanced) AND (SELECT count(*) FROM rang) >= 0
ORDER BY t.n
RETURNING id
""",
    integer,
)


@dataclass(frozen=True, slots=True)
class ScheduleRow:
    """A schedule as the fleet last recorded it."""

    name: str
    task: str
    queue: str
    spec: str
    last_tick: datetime | None  # None: no tick enqueued yet (only the first sight recorded)
    next_tick: datetime | None
    updated_at: datetime


LIST_SCHEDULES = Statement(
    """
SELECT name, task, queue, spec, CASE WHEN ticked THEN last_tick END AS last_tick, next_tick,
       updated_at
FROM {s}.schedules
ORDER BY name
""",
    columns(ScheduleRow),
)
