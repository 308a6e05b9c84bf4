"""Job control inside a worker: cancel requests reaching running jobs, and a job's progress.

A request to cancel a running job is recorded on its row by :func:`aioq.cancel_jobs`, which
also sends a NOTIFY on the schema's control channel. Every worker LISTENs on it (through its
one LISTEN connection) and cancels the run if it holds the job; the :class:`CancelWatch` asks
the database at the heartbeat's interval too, so a notification missed while the LISTEN
connection was down is delivered late but never lost. An async task is cancelled where it
awaits; a sync task runs in a thread that cannot be interrupted, so it only sees
``current_job().cancel_requested`` turn true and keeps its claim until it returns. Either way
the consumer reports the outcome ``cancelled`` and the completer writes it fenced on the claim.
"""

from __future__ import annotations

import logging

from aioq._service import repeat
from aioq.completer import CANCELLED, Running
from aioq.store import Executor, Store

__all__ = ("CancelWatch", "RunHandle", "request_cancel")

logger = logging.getLogger(__name__)


def request_cancel(running: Running) -> bool:
    """Deliver a cancel request to a local run; return False if it had one or is done."""
    if running.finished or running.cancel_requested:
        return False  # an outcome is already on its way: the job keeps it
    running.cancel_requested = True
    if running.interruptible:
        running.cancel(CANCELLED)
    claim = running.claim
    logger.info(
        "job %s %s: cancel requested; %s",
        claim.id,
        claim.task,
        "cancelling it" if running.interruptible else "a sync task: it ends when it returns",
        extra={"job_id": claim.id, "task": claim.task, "queue": claim.queue},
    )
    return True


class CancelWatch:
    """Delivers cancel requests to this worker's running jobs.

    ``on_notify`` is the control channel's handler (immediate); ``run_once`` asks the database
    which of our claims carry a request (the guarantee, one statement per interval).
    """

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

    def on_notify(self, payload: str) -> None:
        """Handle a control-channel notification: the payload is a job id."""
        try:
            job_id = int(payload)
        except ValueError:
            logger.debug("ignoring control notification %r", payload)
            return
        running = self.in_flight.get(job_id)
        if running is not None:
            request_cancel(running)

    async def run_once(self) -> list[int]:
        """Find our running jobs with a cancel request and cancel them; return their ids."""
        held = [r for r in self.in_flight.values() if not r.finished and not r.cancel_requested]
        if not held:
            return []
        ids = [r.claim.id for r in held]
        attempts = [r.claim.attempt for r in held]
        wanted = await self.store.cancel_requested(self.db, ids, attempts, self.worker_id)
        found = []
        for running in held:
            if running.claim.id in wanted and request_cancel(running):
                found.append(running.claim.id)
        return found

    async def run(self) -> None:
        """Watch until cancelled."""

        async def step() -> bool:
            await self.run_once()
            return False

        await repeat("cancel watch", step, lambda: self.interval, logger)


class RunHandle:
    """The running job's side of ``current_job()``: its cancel flag and its progress writes."""

    __slots__ = ("db", "running", "store", "worker_id")

    def __init__(self, running: Running, store: Store, db: Executor, worker_id: str) -> None:
        self.running = running
        self.store = store
        self.db = db
        self.worker_id = worker_id

    @property
    def cancel_requested(self) -> bool:
        """Whether a cancel request reached this run."""
        return self.running.cancel_requested

    async def set_progress(self, progress: float, note: str | None) -> None:
        """Store progress on the job's row, fenced on the claim (a lost claim writes nothing)."""
        claim = self.running.claim
        ours = await self.store.set_progress(
            self.db, claim.id, claim.attempt, self.worker_id, progress, note
        )
        if not ours:
            logger.debug("job %s: progress not stored, the claim is no longer ours", claim.id)
