"""The scheduler: every worker enqueues the due ticks of its registry's schedules.

The schedules themselves (``@aioq.periodic``, :class:`aioq.schedule.Schedule`) are defined in
:mod:`aioq.schedule`; docs/architecture.md, "Periodic ticks".
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from datetime import datetime, timedelta

import anyio
import asyncpg

from aioq.backoff import Failures
from aioq.db import Executor
from aioq.metrics import Metrics
from aioq.schedule import MAX_SKIPPED_COUNT, Schedule
from aioq.sql import schedules as sql
from aioq.worker.service import STEP_BACKOFF, Service

__all__ = ("MAX_SLEEP", "Scheduler")

logger = logging.getLogger(__name__)

# The scheduler looks again at least this often (another worker may have moved a schedule).
MAX_SLEEP = 30.0


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
        start = sql.ScheduleStart(
            name=schedule.name,
            task=schedule.task,
            queue=schedule.queue,
            spec=schedule.spec,
            last_tick=latest,
            next_tick=schedule.next_after(latest),
        )
        created = await sql.SCHEDULE_START.row(self.db, self.schema, start)
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
        tick = sql.ScheduleTick(
            name=schedule.name,
            task=schedule.task,
            queue=schedule.queue,
            spec=schedule.spec,
            ticks=ticks,
            next_tick=schedule.next_after(ticks[-1]),
            args=schedule.args,
            priority=schedule.priority,
            max_attempts=schedule.max_attempts,
            lease=schedule.lease,
        )
        ids = await sql.SCHEDULE_TICK.rows(self.db, self.schema, tick)
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
