"""Leases: the heartbeat that keeps ours, and the reaper that rescues everyone's expired ones."""

from __future__ import annotations

import logging
import time

import anyio
from anyio.abc import TaskStatus

from aioq.db import Executor
from aioq.sql.outcomes import HEARTBEAT, RESCUE_EXPIRED, Rescued
from aioq.worker.claims import CancelReason, Claims
from aioq.worker.service import Service

__all__ = ("Heartbeat", "Reaper")

logger = logging.getLogger(__name__)

# A claim's lease is extended before this fraction of it has passed since its last extension:
# two beats may fail or be late before the lease runs out.
BEAT_FRACTION = 1 / 3


class Heartbeat(Service[list[int]]):
    """Extends the leases of all this worker's claims in one fenced statement.

    The next beat is planned from the claims held: ``interval`` after the last beat, or a
    third of a claim's lease after its claim or last extension, whichever comes first. A new
    claim re-plans the wait, so a short lease claimed while the heartbeat sleeps is extended
    in time whatever the interval (docs/architecture.md, "Leases").
    """

    name = "heartbeat"

    def __init__(
        self, *, schema: str, db: Executor, worker_id: str, claims: Claims, interval: float
    ) -> None:
        super().__init__()
        self.schema = schema
        self.db = db
        self.worker_id = worker_id
        self.claims = claims
        self.beat_interval = interval
        self._last_beat = time.monotonic()

    def due(self) -> float:
        """When the next beat is due, in ``time.monotonic()`` seconds."""
        due = self._last_beat + self.beat_interval
        for running in self.claims.held():
            due = min(due, running.extended_at + running.claim.lease * BEAT_FRACTION)
        return due

    def interval(self) -> float:
        """Seconds until the next beat is due."""
        return max(0.0, self.due() - time.monotonic())

    async def wait(self, seconds: float) -> None:
        """Sleep until the planned beat; a new claim may bring it forward."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            # Only the new claims can bring the beat forward: no scan of every claim held on
            # each claim pass (about 2 % of a worker's CPU at concurrency 1 000).
            if (added := await self.claims.wait_added(left)) is not None:
                first, shortest = added
                deadline = min(deadline, first + shortest * BEAT_FRACTION)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Beat until cancelled; then go on, shielded, while a task thread still runs.

        A thread cannot be interrupted, so a cancel of the whole worker (not a graceful stop)
        would otherwise leave its job unheartbeated: its lease would lapse and another worker
        would run it beside the thread. Its claim is kept alive until it returns, and the
        consumer hands its real outcome to the completer (docs/architecture.md, "Shutdown").
        """
        try:
            await super().run(task_status=task_status)
        finally:
            with anyio.CancelScope(shield=True):
                await self._beat_for_threads()

    async def _beat_for_threads(self) -> None:
        while self.claims.threads():
            try:
                await self.run_once()
            except Exception as exc:
                delay = self.failures.next()
                self.log_failure(exc, delay)
                await anyio.sleep(delay)
                continue
            self.failures.reset()
            with anyio.move_on_after(self.interval()):
                await self.claims.wait_threads_done()

    async def run_once(self) -> list[int]:
        """Extend our leases; cancel the local run of each job whose lease was lost."""
        started = time.monotonic()
        self._last_beat = started
        held = self.claims.held()
        if not held:
            return []
        ids = [r.claim.id for r in held]
        numbers = [r.claim.number for r in held]
        # Keyed by claim, not by job: an older claim of a job claimed again is lost.
        alive = set(await HEARTBEAT.rows(self.db, self.schema, ids, numbers, self.worker_id))
        lost = []
        for running in held:
            if running.claim.key in alive:
                running.extended_at = started
            # A finished job may have been written (deleted, rescheduled) since we read it.
            elif not running.finished:
                lost.append(running.claim.id)
                running.cancel(CancelReason.LEASE_LOST)
                logger.warning(
                    "job %s %s: lease lost (rescued by another worker); cancelling it here",
                    running.claim.id,
                    running.claim.task,
                    extra={
                        "job_id": running.claim.id,
                        "task": running.claim.task,
                        "queue": running.claim.queue,
                        "attempt": running.claim.attempt,
                    },
                )
        return lost


class Reaper(Service[list[Rescued]]):
    """Returns expired claims to pending (or dead when attempts are spent), a batch per pass.

    It leaves its own worker's claims alone: those are heartbeated, and a late beat (an event
    loop blocked by a task) must not make a worker rescue its own running jobs. Other workers
    rescue them if this one is really gone.
    """

    name = "reaper"

    def __init__(
        self,
        *,
        schema: str,
        db: Executor,
        interval: float,
        batch_size: int,
        worker_id: str | None = None,
    ) -> None:
        super().__init__()
        self.schema = schema
        self.db = db
        self.reap_interval = interval
        self.batch_size = batch_size
        self.worker_id = worker_id

    def interval(self) -> float:
        """Seconds between passes that found less than a batch."""
        return self.reap_interval

    def busy(self, result: list[Rescued]) -> bool:
        """A full batch: more may be expired."""
        return len(result) >= self.batch_size

    async def run_once(self) -> list[Rescued]:
        """Rescue up to one batch of expired claims; return (id, new status) for each."""
        rescued = await RESCUE_EXPIRED.rows(self.db, self.schema, self.batch_size, self.worker_id)
        if rescued:
            dead = sum(1 for r in rescued if r.status == "dead")
            cancelled = sum(1 for r in rescued if r.status == "cancelled")
            logger.warning(
                "reaper: %d expired leases rescued (%d to pending, %d dead, %d cancelled)",
                len(rescued),
                len(rescued) - dead - cancelled,
                dead,
                cancelled,
                extra={"rescued": len(rescued), "dead": dead, "cancelled": cancelled},
            )
        return rescued
