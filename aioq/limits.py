"""Fleet-wide queue limits and pauses, stored in the database so every worker obeys them.

``max_running`` caps the jobs of a queue running at once across all workers; ``rate`` caps its
claims in any window of the given length; ``paused`` stops its claims while running jobs
finish. PostgreSQL enforces them: a limited queue's claim locks the queue's row, then counts
its running jobs and recent claims in a fresh snapshot and takes no more than the room left
(:data:`aioq.queries.CLAIM_LIMITED`). Nothing is counted in Python.

A worker claims a queue with no limits through the plain claim statement, unchanged. It learns
which of its queues are limited by a tiny read at most every ``refresh`` seconds, so a limit
set on a queue that had none holds for claims that start after that read (within about a
second); a change to a queue that is already limited holds for the next claim. ``set_queue``
rings the queue's doorbell, so a resume is claimed at once.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

import asyncpg

from aioq.completer import Outcome
from aioq.errors import ConfigError
from aioq.job import Claim
from aioq.store import Connection, Executor, Store
from aioq.task import check_text

__all__ = ("UNSET", "QueueGate", "QueueInfo", "queues", "set_queue")

logger = logging.getLogger(__name__)

DEFAULT_REFRESH = 1.0
MIN_WAKE = 0.01  # the shortest wait for a rate window to move on
RATE_SLOTS = 10  # a rate window is counted in slots of a tenth of its period (see CLAIM_LIMITED)
MAX_INT = 2**31 - 1


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


def _check_name(queue: object) -> str:
    if not isinstance(queue, str) or not queue or len(queue) > 200:
        raise ConfigError(
            "queue", f"must be a non-empty name of at most 200 characters, got {queue!r}"
        )
    check_text("queue", queue)
    return queue


def _check_max_running(queue: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
        raise ConfigError(
            "max_running", f"queue {queue!r}: must be an integer >= 1 or None, got {value!r}"
        )
    return value


def _check_rate(
    queue: str, value: tuple[int, float | timedelta] | None
) -> tuple[int, float] | None:
    if value is None:
        return None
    problem = f"queue {queue!r}: must be (claims, seconds) with claims >= 1 and seconds > 0"
    if not isinstance(value, tuple) or len(value) != 2:
        raise ConfigError("rate", f"{problem}, got {value!r}")
    count, period = value
    seconds = period.total_seconds() if isinstance(period, timedelta) else period
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_INT:
        raise ConfigError("rate", f"{problem}, got {value!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ConfigError("rate", f"{problem}, got {value!r}")
    if not 0 < seconds <= 366 * 86400 or not math.isfinite(seconds):
        raise ConfigError("rate", f"{problem} (at most a year), got {value!r}")
    return count, float(seconds)


async def set_queue(
    conn: Executor,
    queue: str,
    *,
    max_running: int | _Unset | None = UNSET,
    rate: tuple[int, float | timedelta] | _Unset | None = UNSET,
    paused: bool | _Unset = UNSET,
    schema: str = "aioq",
) -> QueueInfo:
    """Set a queue's fleet-wide limits; what is not given stays, None removes a limit.

    ``max_running``: jobs of the queue running at once across all workers. ``rate``:
    ``(claims, seconds)``, at most that many claims in any window of that many seconds.
    ``paused``: no new claims; running jobs finish. Workers see a change without a restart.
    Pausing or resuming a queue that has neither settings nor live jobs raises ConfigError
    (a typo); setting a limit creates the queue's settings. Bad values raise ConfigError and
    change nothing.
    """
    name = _check_name(queue)
    if max_running is UNSET and rate is UNSET and paused is UNSET:
        raise ConfigError("set_queue", f"queue {name!r}: give max_running, rate or paused")
    limit = None if max_running is UNSET else _check_max_running(name, max_running)
    per = None if rate is UNSET else _check_rate(name, rate)
    if paused is not UNSET and not isinstance(paused, bool):
        raise ConfigError("paused", f"queue {name!r}: must be True or False, got {paused!r}")
    store = Store.for_schema(schema)
    changed = await store.set_queue(
        conn,
        name,
        max_running=(max_running is not UNSET, limit),
        rate=(rate is not UNSET, per[0] if per else None, per[1] if per else None),
        paused=(paused is not UNSET, bool(paused) if paused is not UNSET else False),
        must_exist=max_running is UNSET and rate is UNSET,
    )
    if not changed:
        raise ConfigError(
            "queue",
            f"unknown queue {name!r}: it has no settings and no pending or running jobs"
            " (a typo?); set a limit on it first to create it",
        )
    info = {q.name: q for q in await queues(conn, schema=schema)}
    return info[name]


async def queues(conn: Executor, *, schema: str = "aioq") -> list[QueueInfo]:
    """Return every queue that has settings or jobs: its limits and its counts now."""
    store = Store.for_schema(schema)
    settings = {row["name"]: row for row in await store.queue_settings(conn)}
    counts = {row["queue"]: row for row in await store.queue_stats(conn)}
    found = []
    for name in sorted(settings.keys() | counts.keys()):
        s, c = settings.get(name), counts.get(name)
        rate = (s["rate_limit"], s["rate_period"]) if s and s["rate_limit"] is not None else None
        found.append(
            QueueInfo(
                name=name,
                max_running=s["max_running"] if s else None,
                rate=rate,
                paused=bool(s and s["paused"]),
                ready=c["ready"] if c else 0,
                scheduled=c["scheduled"] if c else 0,
                running=c["running"] if c else 0,
                dead=c["dead"] if c else 0,
                window_claims=s["window_claims"] if s else None,
                updated_at=s["updated_at"] if s else None,
            )
        )
    return found


class QueueGate:
    """A worker's claims: limited queues through their limits, the others as they always were.

    Which of the worker's queues are limited is read at most every ``refresh`` seconds, when
    the producer claims; a queue wrongly thought limited costs a turn, never a broken limit.
    """

    def __init__(
        self,
        *,
        store: Store,
        queues: Sequence[str],
        ring: Callable[[], None],
        refresh: float = DEFAULT_REFRESH,
    ) -> None:
        self.store = store
        self.queues = list(queues)
        self.ring = ring
        self.refresh = refresh
        self.limited: frozenset[str] = frozenset()
        self.slots: dict[str, float] = {}  # rate-limited queue -> seconds per counting slot
        # Seconds until a rate-limited queue that had no room may have some: the producer
        # looks again then (no doorbell rings when a rate window moves on).
        self.wake_after = math.inf
        self._read_at = -math.inf
        self._old_schema = False

    async def claim(self, db: Executor, limit: int, worker_id: str) -> list[Claim]:
        """Claim up to ``limit`` jobs of the worker's queues, within their limits."""
        self.wake_after = math.inf
        if time.monotonic() - self._read_at >= self.refresh:
            await self.read(db)
        if not self.limited:
            return await self.store.claim(db, self.queues, limit, worker_id)
        claims: list[Claim] = []
        for queue in self.queues:
            if queue in self.limited and len(claims) < limit:
                wanted = limit - len(claims)
                got, rate_room = await self._claim_limited(db, queue, wanted, worker_id)
                claims += got
                if rate_room is not None and len(got) == rate_room < wanted:
                    # The rate held claims back (not a lack of jobs): look again when the
                    # oldest counted slot may have left the window.
                    slot = self.slots.get(queue, DEFAULT_REFRESH)
                    self.wake_after = min(self.wake_after, max(slot, MIN_WAKE))
        free = [q for q in self.queues if q not in self.limited]
        if free and len(claims) < limit:
            claims += await self.store.claim(db, free, limit - len(claims), worker_id)
        return claims

    async def read(self, db: Executor) -> None:
        """Read which of the worker's queues are limited or paused now."""
        try:
            rows = await self.store.limited_queues(db, self.queues)
        except asyncpg.UndefinedTableError:
            # A schema from before queue limits: no queue can have one. Claim as before, and
            # say once what to run (a missing grant, by contrast, fails the claim loudly).
            if not self._old_schema:
                logger.warning(
                    "schema %s has no queues table (older than this aioq): queue limits are"
                    " off until `aioq schema apply` upgrades it",
                    self.store.schema,
                )
            self._old_schema = True
            rows = {}
        limited = frozenset(rows)
        if limited != self.limited:
            logger.debug("limited queues now: %s", ", ".join(sorted(limited)) or "none")
        self.limited = limited
        self.slots = {q: period / RATE_SLOTS for q, period in rows.items() if period is not None}
        self._read_at = time.monotonic()

    async def _claim_limited(
        self, db: Executor, queue: str, limit: int, worker_id: str
    ) -> tuple[Sequence[Claim], int | None]:
        if isinstance(db, asyncpg.Pool):
            async with db.acquire() as conn:
                return await self._claim_in_turn(conn, queue, limit, worker_id)
        return await self._claim_in_turn(db, queue, limit, worker_id)

    async def _claim_in_turn(
        self, conn: Connection, queue: str, limit: int, worker_id: str
    ) -> tuple[Sequence[Claim], int | None]:
        async with conn.transaction():
            limited = await self.store.lock_queue(conn, queue)
            if limited:
                return await self.store.claim_limited(conn, queue, limit, worker_id)
            # Its limits were removed since we last looked: a plain claim, in the same turn.
            return await self.store.claim(conn, [queue], limit, worker_id), None

    def changed(self) -> None:
        """Limits changed somewhere (a notification): read them before the next claim."""
        self._read_at = -math.inf
        self.ring()

    def written(self, outcomes: Iterable[Outcome]) -> None:
        """After outcomes are written: a limited queue has room again, so claim at once."""
        if self.limited and any(o.claim.queue in self.limited for o in outcomes):
            self.ring()
