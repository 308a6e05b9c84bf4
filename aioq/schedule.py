"""Periodic jobs: the schedules ``@aioq.periodic`` builds, and the scheduler every worker runs.

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

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import anyio
import asyncpg

from aioq.backoff import Failures
from aioq.db import Executor
from aioq.errors import MAX_DURATION, ConfigError
from aioq.metrics import Metrics
from aioq.service import STEP_BACKOFF, Service
from aioq.sql import schedules as sql

__all__ = ("Schedule", "Scheduler")

logger = logging.getLogger(__name__)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
MIN_EVERY = 1.0
# At most this many jobs per schedule from one catch-up (the newest are kept).
MAX_CATCH_UP_TICKS = 10_000
# A skipped-ticks count stops here ("at least N"): counting a long outage tick by tick is waste.
MAX_SKIPPED_COUNT = 10_000
# The scheduler looks again at least this often (another worker may have moved a schedule).
MAX_SLEEP = 30.0


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


def _its_own(exc: Exception) -> bool:
    """Whether a schedule's failure is its own (its values: an overflow, a timestamp the
    database can't store, a bug on its path), not the database's or the connection's (a grant,
    a missing table, a lost connection), which every schedule would meet alike."""
    if isinstance(exc, asyncpg.PostgresError):
        return isinstance(exc, asyncpg.DataError)
    return not isinstance(exc, asyncpg.InterfaceError | OSError | TimeoutError)


class Scheduler(Service[float]):
    """Enqueues the due ticks of a registry's schedules; safe to run on every worker.

    Each schedule is handled on its own: one whose pass raises for its own reasons (a value
    the database refuses, a bug) is logged, counted (``aioq_schedule_failures_total``) and
    tried again with backoff, while the others go on. A failure every schedule would meet (a
    missing grant, a lost connection) ends the pass, as in any service: logged, retried.
    """

    name = "scheduler"

    def __init__(
        self,
        *,
        schema: str,
        db: Executor,
        schedules: Sequence[Schedule],
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__()
        self.schema = schema
        self.db = db
        self.schedules = list(schedules)
        self.metrics = metrics
        self.enqueued = 0  # jobs this scheduler inserted (tests and logs)
        self.failed = 0  # passes of a schedule that raised (tests and logs)
        self._failing: dict[str, tuple[Failures, str]] = {}  # name: its failures, last error
        self._delay = 0.0  # seconds from the last pass to the next tick

    async def run_once(self, now: datetime | None = None) -> float:
        """Enqueue every due tick; return the seconds until the next tick.

        ``now`` replaces the database's clock (for tests); by default the database decides.
        """
        if not self.schedules:
            return MAX_SLEEP
        rows = await sql.SCHEDULE_STATE.rows(self.db, self.schema, [s.name for s in self.schedules])
        last_ticks = {r.name: r.last_tick for r in rows if r.last_tick is not None}
        db_now = rows[0].now
        now = now or db_now
        wake = now + timedelta(seconds=MAX_SLEEP)
        for schedule in self.schedules:
            try:
                last = last_ticks.get(schedule.name)
                if last is None:
                    await self._start(schedule, now)
                else:
                    await self._tick(schedule, last, now)
                upcoming = schedule.next_after(now)
            except Exception as exc:
                if not _its_own(exc):
                    raise  # the database's or the connection's: every schedule's (the loop retries)
                upcoming = now + timedelta(seconds=self._failure(schedule, exc))
            else:
                self._recovered(schedule)
            wake = min(wake, upcoming)
        self._delay = min(max((wake - now).total_seconds(), 0.001), MAX_SLEEP)
        return self._delay

    def _failure(self, schedule: Schedule, exc: Exception) -> float:
        """Log and count a failed pass of one schedule; return the seconds until its next try."""
        self.failed += 1
        if self.metrics is not None:
            self.metrics.observe_schedule_failure(schedule.name)
        failures, last_error = self._failing.get(schedule.name) or (Failures(STEP_BACKOFF), "")
        delay = failures.next()
        error = f"{type(exc).__name__}: {exc}"
        # Loud when it starts failing or fails differently; quiet while it repeats itself.
        loud = error != last_error
        logger.log(
            logging.ERROR if loud else logging.DEBUG,
            "schedule %s (%s) failed (%d in a row), the other schedules go on; retrying in %.2fs",
            schedule.name,
            schedule.spec,
            failures.count,
            delay,
            exc_info=exc if loud else None,
            extra={"schedule": schedule.name},
        )
        self._failing[schedule.name] = (failures, error)
        return delay

    def _recovered(self, schedule: Schedule) -> None:
        failing = self._failing.pop(schedule.name, None)
        if failing is not None:
            logger.info(
                "schedule %s: working again after %d failed passes",
                schedule.name,
                failing[0].count,
                extra={"schedule": schedule.name},
            )

    async def _start(self, schedule: Schedule, now: datetime) -> None:
        """First sight of a schedule: its first job is the next tick, not one in the past."""
        latest = schedule.latest(now) or now
        created = await sql.SCHEDULE_START.row(
            self.db,
            self.schema,
            *(schedule.name, schedule.task, schedule.queue, schedule.spec),
            *(latest, schedule.next_after(latest)),
        )
        if created is not None:
            logger.info(
                "schedule %s (%s): first tick at %s",
                schedule.name,
                schedule.spec,
                f"{schedule.next_after(latest):%Y-%m-%d %H:%M:%S}Z",
                extra={"schedule": schedule.name},
            )

    async def _tick(self, schedule: Schedule, last: datetime, now: datetime) -> None:
        ticks, skipped = schedule.due(last, now)
        if not ticks:
            return
        ids = await sql.SCHEDULE_TICK.rows(
            self.db,
            self.schema,
            *(schedule.name, schedule.task, schedule.queue, schedule.spec),
            *(ticks, schedule.next_after(ticks[-1]), schedule.args),
            *(schedule.priority, schedule.max_attempts, schedule.lease),
        )
        if not ids:
            return  # another worker enqueued these ticks first
        self.enqueued += len(ids)
        if skipped:
            logger.warning(
                "schedule %s: skipped %s%d missed ticks older than catch_up (%gs)",
                schedule.name,
                "at least " if skipped >= MAX_SKIPPED_COUNT else "",
                skipped,
                schedule.catch_up,
                extra={"schedule": schedule.name, "skipped": skipped},
            )
        logger.debug(
            "schedule %s: enqueued %d jobs for ticks up to %s",
            schedule.name,
            len(ids),
            ticks[-1].isoformat(),
            extra={"schedule": schedule.name},
        )

    def interval(self) -> float:
        """Seconds until the next tick, as of the last pass."""
        return self._delay

    async def wait(self, seconds: float) -> None:
        """Sleep until the next tick; after a failed pass, the backoff given.

        Not the service's jittered interval, which could wake a tenth of the wait late: the
        jitter here only ever delays, by at most 20 ms, to spread the fleet's statements.
        """
        if self.failures.count:
            await anyio.sleep(seconds)
        else:
            await anyio.sleep(self._delay + random.uniform(0, 0.02))
