"""Leases: the heartbeat that keeps ours, and the reaper that rescues everyone's expired ones."""

from __future__ import annotations

import logging

from aioq._service import repeat
from aioq.completer import LEASE_LOST, Running
from aioq.store import Executor, Store

__all__ = ("Heartbeat", "Reaper")

logger = logging.getLogger(__name__)


class Heartbeat:
    """Extends the leases of all this worker's claims in one fenced statement."""

    def __init__(
        self,
        *,
        store: Store,
        db: Executor,
        worker_id: str,
        in_flight: dict[int, Running],
        interval: float,
    ) -> None:
        self.store = store
        self.db = db
        self.worker_id = worker_id
        self.in_flight = in_flight
        self.interval = interval

    def next_interval(self) -> float:
        """Beat at the configured interval, or a third of the shortest lease held, if sooner."""
        shortest = min((r.claim.lease for r in self.in_flight.values()), default=self.interval * 3)
        return min(self.interval, shortest / 3)

    async def run_once(self) -> list[int]:
        """Extend our leases; cancel the local run of each job whose lease was lost."""
        held = list(self.in_flight.values())
        if not held:
            return []
        ids = [r.claim.id for r in held]
        attempts = [r.claim.attempt for r in held]
        alive = await self.store.heartbeat(self.db, ids, attempts, self.worker_id)
        lost = []
        for running in held:
            # A finished job may have been written (deleted, rescheduled) since we read it.
            if running.claim.id not in alive and not running.finished:
                lost.append(running.claim.id)
                running.cancel(LEASE_LOST)
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

    async def run(self) -> None:
        """Beat until cancelled."""

        async def step() -> bool:
            await self.run_once()
            return False

        await repeat("heartbeat", step, self.next_interval, logger)


class Reaper:
    """Returns expired claims to pending (or dead when attempts are spent), a batch per pass."""

    def __init__(self, *, store: Store, db: Executor, interval: float, batch_size: int) -> None:
        self.store = store
        self.db = db
        self.interval = interval
        self.batch_size = batch_size

    async def run_once(self) -> list[tuple[int, str]]:
        """Rescue up to one batch of expired claims; return (id, new status) for each."""
        rescued = await self.store.reap(self.db, self.batch_size)
        if rescued:
            dead = sum(1 for _, status in rescued if status == "dead")
            cancelled = sum(1 for _, status in rescued if status == "cancelled")  # jobcontrol
            logger.warning(
                "reaper: %d expired leases rescued (%d to pending, %d dead, %d cancelled)",
                len(rescued),
                len(rescued) - dead - cancelled,
                dead,
                cancelled,
                extra={"rescued": len(rescued), "dead": dead, "cancelled": cancelled},
            )
        return rescued

    async def run(self) -> None:
        """Reap until cancelled; at once again after a full batch."""

        async def step() -> bool:
            return len(await self.run_once()) >= self.batch_size

        await repeat("reaper", step, lambda: self.interval, logger)
