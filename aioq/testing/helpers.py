"""Helpers for testing code that defers jobs: what is waiting, and running it all now."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import asyncpg

from aioq import hooks
from aioq.codec import decode_args
from aioq.db import Target, executor
from aioq.errors import AioqError, PayloadError
from aioq.job import Claim
from aioq.registry import Registry
from aioq.sql.admin import PENDING_JOBS, READY_QUEUES
from aioq.tasks import Task
from aioq.worker import Worker

logger = logging.getLogger(__name__)

__all__ = ("Drain", "DrainError", "Ran", "Waiting", "deferred", "drain")

DEFAULT_MAX_RUNS = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting:
    """A job deferred and not yet run (due now or scheduled), with its arguments read as the
    task's annotations (as stored, if they cannot be)."""

    id: int
    queue: str
    args: dict[str, Any]
    priority: int
    run_at: datetime
    attempts: int
    max_attempts: int
    unique_key: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Ran:
    """One attempt the drain ran, and what became of it."""

    id: int
    task: str
    queue: str
    args: dict[str, Any]
    attempt: int
    # "succeeded", "retried" (failed, will run again later), "snoozed" (aioq.Retry), "dead"
    outcome: str
    error: str | None  # the recorded error (type, message, traceback) of a failed attempt

    @property
    def succeeded(self) -> bool:
        """Whether the attempt returned normally."""
        return self.outcome == "succeeded"


class Drain(Protocol):
    """The ``aioq_drain`` fixture: run every ready job now; return each run."""

    def __call__(
        self, registry: Registry | None = None, /, **worker_options: Any
    ) -> Awaitable[list[Ran]]:
        """Drain the registry's jobs (the ``aioq_registry`` fixture's by default)."""
        ...


class DrainError(AioqError):
    """The drain ran more attempts than allowed: a task keeps deferring or snoozing work."""


async def deferred(conn: Target, task: Task[..., Any]) -> list[Waiting]:
    """Return the jobs ``task`` has waiting (pending, due or scheduled), oldest first."""
    rows = await PENDING_JOBS.rows(await executor(conn), task.registry.schema, task.name)
    return [
        Waiting(
            id=row.id,
            queue=row.queue,
            args=typed_args(task, row.args, row.id),
            priority=row.priority,
            run_at=row.run_at,
            attempts=row.attempts,
            max_attempts=row.max_attempts,
            unique_key=row.unique_key,
        )
        for row in rows
    ]


def typed_args(task: Task[..., Any] | None, text: str, job_id: int) -> dict[str, Any]:
    """A job's stored arguments read as its task's annotations; as stored (JSON) when the task
    is unknown or they cannot be read (the run fails with a PayloadError)."""
    args = decode_args(text)
    if task is None:
        return args
    try:
        return task.codec.decode(dict(args), job_id)
    except PayloadError:
        return args


class _Recorder(hooks.Observer):
    """Collect the outcomes one worker wrote; stop it past ``room`` of them."""

    def __init__(self, worker: Worker, room: int) -> None:
        self.worker = worker
        self.worker_id = worker.id
        self.room = room
        self.ran: list[Ran] = []

    def settled(
        self,
        worker_id: str,
        outcome: str,
        settled: Sequence[tuple[Claim, str | None]],
        start_ns: int,
        end_ns: int,
    ) -> None:
        if worker_id != self.worker_id:
            return  # another worker of this process (an aioq_worker fixture, the app's own)
        for claim, error in settled:
            args: dict[str, Any] = {}
            with suppress(ValueError):  # undecodable: the run failed with a PayloadError
                args = typed_args(self.worker.registry.get(claim.task), claim.args, claim.id)
            self.ran.append(
                Ran(
                    id=claim.id,
                    task=claim.task,
                    queue=claim.queue,
                    args=args,
                    attempt=claim.attempt,
                    outcome=outcome,
                    error=error,
                )
            )
        if len(self.ran) > self.room:
            self.worker.stop()


async def drain(
    dsn: str, registry: Registry, *, max_runs: int = DEFAULT_MAX_RUNS, **worker_options: Any
) -> list[Ran]:
    """Run every job that is ready now, and those they defer, until none is; return each run.

    Jobs whose attempt failed and were rescheduled for later are reported ``retried`` and
    left for later (a drain does not wait for backoffs). Serves every queue that holds a
    ready job, pass after pass, so jobs deferred by tasks into other queues run too.
    """
    worker_options.setdefault("poll_interval", 0.05)
    worker_options.setdefault("listen", False)  # a pass ends when idle; no doorbell needed
    worker_options.setdefault("shutdown_grace", 5.0)
    # The drain's registry is the whole fleet: no worker that knows a task it lacks will come,
    # so such a job is dead at once (UnknownTaskError), not left waiting for one.
    worker_options.setdefault("unknown_task_grace", 0.0)
    conn = await asyncpg.connect(dsn)
    ran: list[Ran] = []
    try:
        while queues := await READY_QUEUES.rows(conn, registry.schema):
            # A fresh worker per pass: it serves the queues that are ready now.
            worker = Worker(dsn=dsn, registry=registry, queues=queues, **worker_options)
            recorder = _Recorder(worker, max_runs - len(ran))
            hooks.install(recorder)
            try:
                await worker.run_until_idle()
            finally:
                hooks.uninstall(recorder)
            ran += recorder.ran
            if len(ran) > max_runs:
                raise DrainError(
                    f"the drain ran {len(ran)} attempts (max_runs={max_runs}) and jobs are"
                    " still ready: do tasks keep deferring or snoozing work?"
                )
    finally:
        await conn.close()
    _warn_unknown(ran, registry)
    return ran


def _warn_unknown(ran: Sequence[Ran], registry: Registry) -> None:
    """Say why runs failed with UnknownTaskError: most often, the plugin's registry is aioq's
    default one while the app's tasks live in a registry of their own."""
    if unknown := sorted({r.task for r in ran if registry.get(r.task) is None}):
        logger.warning(
            "the drain's registry (%d tasks) has no task %s, whose jobs failed with"
            " UnknownTaskError: %s",
            len(registry),
            ", ".join(unknown),
            REGISTRY_FIX,
        )


REGISTRY_FIX = (
    "with the pytest plugin, return your app's registry from an aioq_registry fixture in"
    " conftest.py (the default is aioq.registry.default_registry)"
)
