"""Periodic jobs: the scheduler's statements. docs/architecture.md, "Periodic ticks"."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.sql import Named, Statement, columns, integer, text

__all__ = (
    "LIST_SCHEDULES",
    "SCHEDULE_START",
    "SCHEDULE_STATE",
    "SCHEDULE_TICK",
    "ScheduleRow",
    "ScheduleStart",
    "ScheduleState",
    "ScheduleTick",
)


@dataclass(frozen=True, slots=True)
class ScheduleState:
    """The database's clock, and the last tick enqueued of a schedule (None: never seen)."""

    now: datetime
    name: str
    last_tick: datetime | None


# The database's clock comes with the rows: ticks are judged by it.
SCHEDULE_STATE = Statement(
    """
SELECT clock_timestamp() AS now, n.name, s.last_tick
FROM unnest(:names::text[]) AS n(name)
LEFT JOIN @schema.schedules AS s ON s.name = n.name
""",
    columns(ScheduleState),
    ("names",),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleStart:
    """A schedule seen for the first time: what it runs, and its latest past and next tick."""

    name: str
    task: str
    queue: str
    spec: str
    last_tick: datetime
    next_tick: datetime


# First sight of a schedule: record its latest past tick as done (not ticked: nothing was
# enqueued for it), so its first job is the next tick. A worker that finds the row already
# there changes nothing (no row comes back).
SCHEDULE_START = Named(
    ScheduleStart,
    """
INSERT INTO @schema.schedules (name, task, queue, spec, last_tick, next_tick, ticked)
VALUES (:name, :task, :queue, :spec, :last_tick, :next_tick, false)
ON CONFLICT (name) DO NOTHING
RETURNING name
""",
    text,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleTick:
    """Ticks of a schedule to enqueue (ascending), and the job each tick gets."""

    name: str
    task: str
    queue: str
    spec: str
    ticks: list[datetime]
    next_tick: datetime
    args: str  # the job's arguments (JSON text)
    priority: int
    max_attempts: int
    lease: float  # seconds


# Enqueue the ticks once: the UPDATE advances last_tick only while it is older than the first of
# them, and the jobs are inserted only if it did. Two workers racing: the second waits for the
# first's row lock, re-reads the row it committed, and matches nothing. A late worker whose tick
# already ran (its job deleted) matches nothing either.
SCHEDULE_TICK = Named(
    ScheduleTick,
    """
WITH advanced AS (
    UPDATE @schema.schedules
    SET task = :task, queue = :queue, spec = :spec,
        last_tick = (:ticks::timestamptz[])[cardinality(:ticks::timestamptz[])],
        next_tick = :next_tick, ticked = true, updated_at = now()
    WHERE name = :name AND last_tick < (:ticks::timestamptz[])[1]
    RETURNING name
),
ready_queues(queue) AS (
    SELECT :queue::text
    WHERE EXISTS (SELECT FROM advanced) AND (:ticks::timestamptz[])[1] <= now()
),
@rang
INSERT INTO @schema.jobs (queue, task, args, priority, run_at, max_attempts, lease, scheduled_at)
SELECT :queue, :task, :args::text::jsonb, :priority, t.tick, :max_attempts,
       make_interval(secs => :lease::float8), t.tick
FROM unnest(:ticks::timestamptz[]) WITH ORDINALITY AS t(tick, n)
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
FROM @schema.schedules
ORDER BY name
""",
    columns(ScheduleRow),
)
