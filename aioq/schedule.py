"""Periodic jobs: the schedules ``@aioq.periodic`` builds (the scheduler every worker runs is
:mod:`aioq.worker.scheduler`).

Every worker whose registry holds a schedule enqueues its ticks; the database decides which one
wins. ``schedules.last_tick`` is the latest tick enqueued, and one statement both inserts a
tick's jobs and advances it, on the condition that it is still older than the first of those
ticks (:data:`aioq.sql.schedules.SCHEDULE_TICK`). A worker that lost the race, or that comes late
after the tick's job already ran and left the table, changes nothing. No lock is held between
statements and no worker is elected: any worker that is up enqueues the tick.

Ticks are aligned to the schedule, not to a worker's start: ``every`` counts from the Unix
epoch in UTC (``every=60`` ticks on the minute), ``cron`` follows its time zone as cronsim
does, DST included. Times come from the database's clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from aioq.errors import MAX_DURATION, ConfigError

__all__ = ("Schedule",)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
MIN_EVERY = 1.0
# At most this many jobs per schedule from one catch-up (the newest are kept).
MAX_CATCH_UP_TICKS = 10_000
# A skipped-ticks count stops here ("at least N"): counting a long outage tick by tick is waste.
MAX_SKIPPED_COUNT = 10_000


def _cronsim() -> Any:
    try:
        import cronsim
    except ImportError:
        return None
    return cronsim


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """When a task's periodic jobs are due, and the job each tick enqueues.

    Built by :func:`aioq.periodic`, which checks the arguments against the task and takes
    the task's options: a schedule holds plain values (it never imports the task module,
    whose registry holds the schedules).
    """

    name: str
    task: str  # the task's name
    args: str  # the task's keyword arguments for every tick, as stored JSON
    queue: str
    priority: int
    max_attempts: int
    lease: float
    every: float | None = None
    cron: str | None = None
    tz: str = "UTC"
    catch_up: float = 0.0
    _zone: tzinfo = field(init=False, repr=False)

    def __post_init__(self) -> None:
        where = f"task {self.task!r}"
        if (self.every is None) == (self.cron is None):
            raise ConfigError("periodic", f"{where}: give exactly one of every= or cron=")
        # Bounded like every other duration: a tick past year 9999 (every=1e12, inf) or a
        # catch-up window before year 1 (catch_up=inf) would overflow datetime on every pass.
        if self.every is not None and not MIN_EVERY <= self.every <= MAX_DURATION:
            raise ConfigError(
                "every",
                f"{where}: must be at least {MIN_EVERY:g} second and at most {MAX_DURATION:.0f}"
                f" (a century), got {self.every!r}",
            )
        if not 0 <= self.catch_up <= MAX_DURATION:
            raise ConfigError(
                "catch_up",
                f"{where}: must be >= 0 seconds and at most {MAX_DURATION:.0f} (a century),"
                f" got {self.catch_up!r}",
            )
        try:
            zone = ZoneInfo(self.tz)
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            raise ConfigError("tz", f"{where}: unknown time zone {self.tz!r}") from None
        if self.every is not None and self.tz != "UTC":
            raise ConfigError("tz", f"{where}: tz applies to cron= only; every= counts in UTC")
        object.__setattr__(self, "_zone", zone)
        if self.cron is not None:
            cronsim = _cronsim()
            if cronsim is None:
                raise ConfigError(
                    "cron", f"{where}: cron= needs the cron extra: pip install 'aioq-pg[cron]'"
                )
            try:
                cronsim.CronSim(self.cron, datetime.now(zone))
            except cronsim.CronSimError as exc:
                raise ConfigError(
                    "cron", f"{where}: bad cron expression {self.cron!r}: {exc}"
                ) from None

    @property
    def spec(self) -> str:
        """The schedule in words: ``every 60s`` or ``cron */5 * * * * Europe/Paris``."""
        if self.every is not None:
            return f"every {self.every:g}s"
        return f"cron {self.cron} {self.tz}"

    def next_after(self, t: datetime) -> datetime:
        """Return the first tick strictly after ``t`` (in UTC)."""
        if self.every is not None:
            step = self._step_us()
            return _from_us((_to_us(t) // step + 1) * step)
        cronsim = _cronsim()
        local = t.astimezone(self._zone)
        return next(iter(cronsim.CronSim(self.cron, local))).astimezone(UTC)  # type: ignore[no-any-return]

    def ticks(self, after: datetime, until: datetime, limit: int) -> list[datetime]:
        """Return the ticks in ``(after, until]``, oldest first, at most ``limit`` (the newest)."""
        if self.every is not None:
            step = self._step_us()
            first = _to_us(after) // step + 1
            last = _to_us(until) // step
            first = max(first, last - limit + 1)
            return [_from_us(k * step) for k in range(first, last + 1)]
        found: list[datetime] = []
        t = self.next_after(after)
        while t <= until:
            found.append(t)
            if len(found) > limit:
                del found[0]
            t = self.next_after(t)
        return found

    def latest(self, t: datetime) -> datetime | None:
        """Return the latest tick at or before ``t``, or None if there was none."""
        if self.every is not None:
            step = self._step_us()
            return _from_us(_to_us(t) // step * step)
        # Find a starting point before the latest tick going backwards, then walk forwards so
        # the answer is a tick of the forward sequence (the one next_after() gives), DST quirks
        # included: backwards and forwards iteration may differ inside a DST transition.
        cronsim = _cronsim()
        back = iter(cronsim.CronSim(self.cron, t.astimezone(self._zone), reverse=True))
        try:
            anchor = next(back).astimezone(UTC) - timedelta(hours=2)
        except StopIteration:
            return None
        found = self.ticks(anchor, t, 1)
        return found[-1] if found else None

    def due(self, last: datetime, now: datetime) -> tuple[list[datetime], int]:
        """Return the ticks to enqueue after ``last`` as of ``now``, and how many are skipped.

        The latest tick at or before ``now`` is always due if it is newer than ``last``; the
        ticks missed before it are due if they fall within ``catch_up`` seconds of ``now``.
        """
        latest = self.latest(now)
        if latest is None or latest <= last:
            return [], 0
        start = max(last, now - timedelta(seconds=self.catch_up) - _US)
        ticks = self.ticks(start, latest, MAX_CATCH_UP_TICKS) or [latest]
        return ticks, self.count(last, ticks[0] - _US, MAX_SKIPPED_COUNT)

    def count(self, after: datetime, until: datetime, cap: int) -> int:
        """Return how many ticks fall in ``(after, until]``, counting no further than ``cap``."""
        if self.every is not None:
            step = self._step_us()
            return min(cap, max(0, _to_us(until) // step - _to_us(after) // step))
        n, t = 0, self.next_after(after)
        while t <= until and n < cap:
            n, t = n + 1, self.next_after(t)
        return n

    def _step_us(self) -> int:
        assert self.every is not None
        return round(self.every * 1_000_000)


def _to_us(t: datetime) -> int:
    return (t - EPOCH) // _US


def _from_us(us: int) -> datetime:
    return EPOCH + timedelta(microseconds=us)
