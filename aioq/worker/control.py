"""Job control inside a worker: cancel requests reaching running jobs, and a job's progress.

A request to cancel a running job is recorded on its row by :func:`aioq.admin.cancel_jobs`, which
also sends a NOTIFY on the schema's control channel. Every worker LISTENs on it (through its
one LISTEN connection) and cancels the run if it holds the job; the :class:`CancelWatch` asks
the database at the heartbeat's interval too, so a notification missed while the LISTEN
connection was down is delivered late but never lost. An async task is cancelled where it
awaits; a sync task runs in a thread that cannot be interrupted, so it sees
``current_job().cancel_requested`` turn true and keeps its claim until it returns. Either way
the consumer reports the outcome ``cancelled`` and the completer writes it fenced on the claim.
"""

from __future__ import annotations

import logging
from typing import Any

from aioq.codec import decode_result
from aioq.db import Executor
from aioq.job import StepFailed
from aioq.registry import Registry
from aioq.sql.control import CANCEL_REQUESTED, SET_PROGRESS, SetProgress
from aioq.sql.workflows import UPSTREAM
from aioq.worker.claims import CancelReason, Claims, Running
from aioq.worker.service import Service

__all__ = ("CancelWatch", "RunHandle", "request_cancel")

logger = logging.getLogger(__name__)


def request_cancel(running: Running) -> bool:
    """Deliver a cancel request to a local run; return False if it had one or is done."""
    if running.finished or running.cancel_requested:
        return False  # an outcome is already on its way: the job keeps it
    running.cancel_requested = True
    # A thread runs on until it returns (the claim is kept); its scope reports the cancel then.
    running.cancel(CancelReason.CANCELLED)
    claim = running.claim
    logger.info(
        "job %s %s: cancel requested; %s",
        claim.id,
        claim.task,
        "a sync task: it ends when it returns" if running.in_thread else "cancelling it",
        extra={"job_id": claim.id, "task": claim.task, "queue": claim.queue},
    )
    return True


class CancelWatch(Service[list[int]]):
    """Delivers cancel requests to this worker's running jobs.

    ``on_notify`` is the control channel's handler (immediate); ``run_once`` asks the database
    which of our claims carry a request (the guarantee, one read per interval).
    """

    name = "cancel watch"

    def __init__(
        self, *, schema: str, db: Executor, worker_id: str, claims: Claims, interval: float
    ) -> None:
        super().__init__()
        self.schema = schema
        self.db = db
        self.worker_id = worker_id
        self.claims = claims
        self.seconds = interval

    def interval(self) -> float:
        """The heartbeat's interval: a missed notification arrives at most this late."""
        return self.seconds

    def on_notify(self, payload: str) -> None:
        """Handle a control-channel notification: the payload is a job id."""
        try:
            job_id = int(payload)
        except ValueError:
            logger.debug("ignoring control notification %r", payload)
            return
        for running in self.claims.held():
            if running.claim.id == job_id:
                request_cancel(running)

    async def run_once(self) -> list[int]:
        """Find our running jobs with a cancel request and cancel them; return their ids."""
        held = [r for r in self.claims.held() if not r.finished and not r.cancel_requested]
        if not held:
            return []
        ids = [r.claim.id for r in held]
        numbers = [r.claim.number for r in held]
        wanted = set(
            await CANCEL_REQUESTED.rows(self.db, self.schema, ids, numbers, self.worker_id)
        )
        return [r.claim.id for r in held if r.claim.id in wanted and request_cancel(r)]


class RunHandle:
    """The running job's side of ``current_job()``: its cancel flag and its progress writes."""

    __slots__ = ("db", "registry", "running", "schema", "worker_id")

    def __init__(
        self, running: Running, schema: str, db: Executor, worker_id: str, registry: Registry
    ) -> None:
        self.running = running
        self.schema = schema
        self.db = db
        self.worker_id = worker_id
        self.registry = registry  # reads each dependency's result as its task's return type

    @property
    def cancel_requested(self) -> bool:
        """Whether a cancel request reached this run."""
        return self.running.cancel_requested

    async def set_progress(self, progress: float, note: str | None) -> None:
        """Store progress on the job's row, fenced on the claim (a lost claim writes nothing)."""
        claim = self.running.claim
        ours = await SET_PROGRESS.row(
            self.db,
            self.schema,
            SetProgress(
                id=claim.id,
                claim=claim.number,
                worker=self.worker_id,
                progress=progress,
                note=note,
            ),
        )
        if ours is None:
            logger.debug("job %s: progress not stored, the claim is no longer ours", claim.id)

    async def upstream(self) -> dict[str, Any]:
        """The results of this step's direct dependencies by step name (a plain job: none),
        each read as its task's return annotation when this worker's registry has the task
        (else the JSON as stored)."""
        claim = self.running.claim
        if claim.workflow_id is None:
            return {}
        found: dict[str, Any] = {}
        for row in await UPSTREAM.rows(self.db, self.schema, claim.id):
            if row.status == "succeeded":
                value = None if row.result is None else decode_result(row.result)
                task = self.registry.get(row.task)
                found[row.name] = (
                    value if task is None else task.codec.decode_result(value, row.job_id)
                )
            else:
                found[row.name] = StepFailed(row.name, row.job_id, row.status, row.last_error)
        return found
