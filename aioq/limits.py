"""Fleet-wide queue limits and pauses, stored in the database so every worker obeys them.

``max_running`` caps the jobs of a queue running at once across all workers; ``rate`` caps its
claims in any window of the given length; ``paused`` stops its claims while running jobs
finish. PostgreSQL enforces them: a limited queue's claim locks the queue's row, then counts
its running jobs and recent claims in a fresh snapshot and takes no more than the room left
(:data:`aioq.sql.limits.CLAIM_LIMITED`). Nothing is counted in Python.

A worker claims a queue with no limits through the plain claim statement, unchanged
(aioq.worker.claimer). It learns which of its queues are limited by a tiny read at most every
second, and at once when ``set_queue`` notifies a change, so a limit set on a queue that had none
holds for claims that start after that read; a change to a queue that is already limited holds
for the next claim. ``set_queue`` rings the queue's doorbell, so a resume is claimed at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from aioq.db import Target, executor
from aioq.dbapi import SyncTarget
from aioq.dbapi import executor as sync_executor
from aioq.errors import ConfigError
from aioq.options import check_queue
from aioq.sql import DEFAULT_SCHEMA, channel_name
from aioq.sql import limits as sql
from aioq.sql.admin import QUEUE_STATS, QueueCounts

__all__ = ("UNSET", "QueueInfo", "queues", "queues_sync", "set_queue", "set_queue_sync")

MAX_INT = 2**31 - 1  # the limits are integer columns
# The rate's period is an interval (microseconds; CHECK > 0) whose tenth is a counting slot
# (aioq.sql.limits.CLAIM_LIMITED): a period under a millisecond would round to an empty
# interval or to slots too short to count in.
MIN_RATE_PERIOD = 0.001
MAX_RATE_PERIOD = 366 * 86400.0


class _Unset(enum.Enum):
    UNSET = "UNSET"


UNSET: Final = _Unset.UNSET
"""Leave a setting as it is (``None`` removes a limit)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueInfo:
    """A queue's limits and what it holds now."""

    name: str
    max_running: int | None
    rate: tuple[int, float] | None  # at most rate[0] claims in any rate[1] seconds
    paused: bool
    ready: int
    scheduled: int
    running: int
    dead: int
    window_claims: int | None  # claims counted in the rate window now (None: no rate)
    updated_at: datetime | None  # when its settings last changed (None: never set)
    max_running_per_key: int | None = None  # jobs of one concurrency key running at once


def _check_max_running(queue: str, value: int | None, field: str = "max_running") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
        raise ConfigError(field, f"queue {queue!r}: must be an integer >= 1 or None, got {value!r}")
    return value


def _check_rate(
    queue: str, value: tuple[int, float | timedelta] | None
) -> tuple[int, float] | None:
    if value is None:
        return None
    problem = (
        f"queue {queue!r}: must be (claims, seconds) with claims from 1 to {MAX_INT} and seconds"
        f" from {MIN_RATE_PERIOD:g} to {MAX_RATE_PERIOD:.0f} (a year)"
    )
    if not isinstance(value, tuple) or len(value) != 2:
        raise ConfigError("rate", f"{problem}, got {value!r}")
    count, period = value
    seconds = period.total_seconds() if isinstance(period, timedelta) else period
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_INT:
        raise ConfigError("rate", f"{problem}, got {value!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ConfigError("rate", f"{problem}, got {value!r}")
    if not MIN_RATE_PERIOD <= seconds <= MAX_RATE_PERIOD:  # NaN fails both
        raise ConfigError("rate", f"{problem}, got {value!r}")
    return count, float(seconds)


async def set_queue(
    conn: Target,
    queue: str,
    *,
    max_running: int | _Unset | None = UNSET,
    rate: tuple[int, float | timedelta] | _Unset | None = UNSET,
    paused: bool | _Unset = UNSET,
    max_running_per_key: int | _Unset | None = UNSET,
    schema: str = DEFAULT_SCHEMA,
) -> QueueInfo:
    """Set a queue's fleet-wide limits; what is not given stays, None removes a limit.

    ``max_running``: jobs of the queue running at once across all workers. ``rate``:
    ``(claims, seconds)``, at most that many claims in any window of that many seconds.
    ``paused``: no new claims; running jobs finish. ``max_running_per_key``: jobs of one
    concurrency key (``options(concurrency_key=...)`` or the task's key function) running at
    once across all workers; at equal priority the claim then takes the keys in turn, so a
    key with a large backlog does not delay the others. Workers see a change without a restart.
    Pausing any valid queue name creates its settings (pause a queue before a deploy sends it
    jobs); resuming a queue that has neither settings nor live jobs raises ConfigError (a typo:
    it was never paused). Setting a limit creates the queue's settings. Bad values raise
    ConfigError and change nothing.
    """
    settings = _set_queue_values(queue, max_running, rate, paused, max_running_per_key, schema)
    db = await executor(conn)
    changed = await sql.SET_QUEUE.row(db, schema, settings)
    if changed is None:
        raise _unknown_queue(settings.queue)
    info = {q.name: q for q in await queues(db, schema=schema)}
    return info[settings.queue]


def set_queue_sync(
    conn: SyncTarget,
    queue: str,
    *,
    max_running: int | _Unset | None = UNSET,
    rate: tuple[int, float | timedelta] | _Unset | None = UNSET,
    paused: bool | _Unset = UNSET,
    max_running_per_key: int | _Unset | None = UNSET,
    schema: str = DEFAULT_SCHEMA,
) -> QueueInfo:
    """Set a queue's fleet-wide limits, as :func:`set_queue` does, from synchronous code."""
    settings = _set_queue_values(queue, max_running, rate, paused, max_running_per_key, schema)
    db = sync_executor(conn)
    if sql.SET_QUEUE.row_sync(db, schema, settings) is None:
        raise _unknown_queue(settings.queue)
    info = {q.name: q for q in queues_sync(conn, schema=schema)}
    return info[settings.queue]


def _set_queue_values(
    queue: str,
    max_running: int | _Unset | None,
    rate: tuple[int, float | timedelta] | _Unset | None,
    paused: bool | _Unset,
    max_running_per_key: int | _Unset | None,
    schema: str,
) -> sql.SetQueue:
    """Check set_queue's arguments; return SET_QUEUE's values."""
    name = check_queue("queue", queue)
    nothing = max_running is UNSET and rate is UNSET and max_running_per_key is UNSET
    if nothing and paused is UNSET:
        raise ConfigError(
            "set_queue",
            f"queue {name!r}: give max_running, rate or paused (or max_running_per_key)",
        )
    limit = None if max_running is UNSET else _check_max_running(name, max_running)
    per_key = (
        None
        if max_running_per_key is UNSET
        else _check_max_running(name, max_running_per_key, "max_running_per_key")
    )
    per = None if rate is UNSET else _check_rate(name, rate)
    if paused is not UNSET and not isinstance(paused, bool):
        raise ConfigError("paused", f"queue {name!r}: must be True or False, got {paused!r}")
    return sql.SetQueue(
        queue=name,
        set_max_running=max_running is not UNSET,
        max_running=limit,
        set_rate=rate is not UNSET,
        rate_limit=per[0] if per else None,
        rate_period=per[1] if per else None,
        set_paused=paused is not UNSET,
        paused=bool(paused) if paused is not UNSET else False,
        must_exist=nothing and paused is False,  # a resume alone
        doorbell=channel_name(schema),
        set_max_running_per_key=max_running_per_key is not UNSET,
        max_running_per_key=per_key,
    )


def _unknown_queue(name: str) -> ConfigError:
    return ConfigError(
        "queue",
        f"unknown queue {name!r}: it has no settings and no pending or running jobs,"
        " so it is not paused (a typo?)",
    )


async def queues(conn: Target, *, schema: str = DEFAULT_SCHEMA) -> list[QueueInfo]:
    """Return every queue that has settings or jobs: its limits and its counts now."""
    conn = await executor(conn)
    settings = await sql.QUEUE_SETTINGS.rows(conn, schema)
    return _queues(settings, await QUEUE_STATS.rows(conn, schema))


def queues_sync(conn: SyncTarget, *, schema: str = DEFAULT_SCHEMA) -> list[QueueInfo]:
    """Return every queue that has settings or jobs, as :func:`queues` does, from synchronous
    code."""
    db = sync_executor(conn)
    settings = sql.QUEUE_SETTINGS.rows_sync(db, schema)
    return _queues(settings, QUEUE_STATS.rows_sync(db, schema))


def _queues(
    settings_rows: list[sql.QueueSettings], count_rows: list[QueueCounts]
) -> list[QueueInfo]:
    settings = {row.name: row for row in settings_rows}
    counts = {row.queue: row for row in count_rows}
    found = []
    for name in sorted(settings.keys() | counts.keys()):
        s, c = settings.get(name), counts.get(name)
        rate = None
        if s is not None and s.rate_limit is not None and s.rate_period is not None:
            rate = (s.rate_limit, s.rate_period)
        found.append(
            QueueInfo(
                name=name,
                max_running=s.max_running if s else None,
                rate=rate,
                paused=bool(s and s.paused),
                ready=c.ready if c else 0,
                scheduled=c.scheduled if c else 0,
                running=c.running if c else 0,
                dead=c.dead if c else 0,
                window_claims=s.window_claims if s else None,
                updated_at=s.updated_at if s else None,
                max_running_per_key=s.max_running_per_key if s else None,
            )
        )
    return found
