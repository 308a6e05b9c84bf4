"""What a job is: its status, its row, the claim that fences it, and the context a task sees.

The statuses and the outcomes of an attempt are defined with the state machine, in
:mod:`aioq.states` (imported here, where they have always been found)."""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aioq.errors import AioqError, ConfigError
from aioq.states import JobStatus, OutcomeKind

if TYPE_CHECKING:
    from aioq.db import Row

__all__ = (
    "Claim",
    "ClaimKey",
    "Job",
    "JobContext",
    "JobHandle",
    "JobStatus",
    "OutcomeKind",
    "StepFailed",
    "current_job",
    "possible_id",
)

S = TypeVar("S")

MIN_JOB_ID, MAX_JOB_ID = -(2**63), 2**63 - 1
"""Job ids are bigint: no job has an id outside this range, and the driver refuses to send one."""


def possible_id(job_id: int) -> bool:
    """Whether a job could have this id (a caller's id outside bigint is an absent job)."""
    return MIN_JOB_ID <= job_id <= MAX_JOB_ID


ClaimKey = tuple[int, int]
"""(job id, claim number): the identity of one claim, never reused."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A job as stored, for inspection.

    A ``succeeded`` job comes from the results (tasks with ``result_ttl``) or the archive,
    which keep no run_at, lease, error or unique_key: there ``run_at`` and ``locked_at`` are
    when the successful attempt started, ``locked_by`` the worker that ran it, ``lease`` None,
    and ``finished_at`` is set.
    """

    id: int
    queue: str
    task: str
    args: str
    status: JobStatus
    priority: int
    run_at: datetime
    attempts: int
    max_attempts: int
    lease: float | None
    locked_by: str | None
    locked_at: datetime | None
    lease_expires_at: datetime | None
    last_error: str | None
    unique_key: str | None
    created_at: datetime
    finished_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    progress: float | None = None  # 0..1, as the task last reported it
    progress_note: str | None = None
    result: str | None = None  # the stored return value as JSON text (succeeded jobs)
    # The worker of its latest claim that ended without deleting it (retried, dead, cancelled,
    # released, rescued): locked_by is cleared then. For a succeeded job, the one that ran it.
    last_worker: str | None = None
    workflow_id: int | None = None  # the workflow run of a step (aioq.workflow), else None
    # When a worker that does not know its task first claimed it: it waits for one that does
    # (docs/architecture.md, "Unknown tasks"); None otherwise.
    unknown_since: datetime | None = None

    @classmethod
    def from_row(cls, row: Row) -> Job:
        """Build a job from a row of ``GET_JOB`` / ``LIST_JOBS``."""
        values = dict(row.items())
        values["status"] = JobStatus(values["status"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Claim:
    """One claim of a job: what every later update is fenced on.

    ``number`` counts the job's claims and never decreases (a snooze, a release or a replay
    leaves it alone), so :attr:`key` identifies this claim among every claim of the job,
    past and future; ``attempt`` can repeat (a release refunds it, a replay resets it).
    """

    id: int
    number: int
    queue: str
    task: str
    args: str  # raw JSON text; decoded by the consumer so one bad payload fails only its job
    priority: int
    attempt: int
    max_attempts: int
    lease: float
    waited: float  # seconds from run_at to the claim
    traceparent: str | None = None  # W3C trace context of the defer (aioq.contrib.otel)
    snoozes: int = 0  # how many times the job raised aioq.Retry before this claim
    scheduled_at: datetime | None = None  # the tick of a periodic job
    workflow_id: int | None = None  # the run of a workflow step (None: a plain job)
    # Seconds since a worker that did not know its task first claimed it (None: none did);
    # docs/architecture.md, "Unknown tasks".
    unknown_for: float | None = None

    @property
    def key(self) -> ClaimKey:
        """The identity of this claim: (job id, claim number)."""
        return (self.id, self.number)

    @classmethod
    def from_row(cls, row: Row) -> Claim:
        """Build a claim from a row of the claim statement."""
        # Positional: per claimed job, keywords cost more than the rest of this call.
        return cls(
            row["id"],
            row["claims"],
            row["queue"],
            row["task"],
            row["args"],
            row["priority"],
            row["attempts"],
            row["max_attempts"],
            row["lease"],
            max(0.0, row["waited"] or 0.0),
            row["traceparent"],
            row["snoozes"],
            row["scheduled_at"],
            row["workflow_id"],
            row["unknown_for"],
        )


@dataclass(frozen=True, slots=True)
class StepFailed:
    """What ``upstream()`` gives for a dependency that did not succeed: a step added with
    ``on_failure="run"`` runs anyway, and sees which of its dependencies failed and why."""

    name: str
    job_id: int
    status: str  # dead or cancelled
    error: str | None


class JobHandle(Protocol):
    """What a running job's context asks its worker (see :mod:`aioq.worker.control`)."""

    @property
    def cancel_requested(self) -> bool: ...

    async def set_progress(self, progress: float, note: str | None) -> None: ...

    async def upstream(self) -> dict[str, Any]: ...


MAX_PROGRESS_NOTE = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class JobContext:
    """What a running task knows about its job; ``id`` is the stable idempotency key.

    ``attempt`` counts the runs of the job, snoozes included (a release on shutdown is not
    counted); ``max_attempts`` grows by one per snooze, so a snooze never spends the failure
    budget; ``snoozes`` says how many runs ended in ``aioq.Retry``.
    """

    id: int
    attempt: int
    max_attempts: int
    task: str
    queue: str
    worker_id: str
    snoozes: int = 0
    scheduled_at: datetime | None = None  # the tick a periodic job runs for, else None
    handle: JobHandle | None = field(default=None, repr=False, compare=False)
    # What the worker's lifespan yielded (an HTTP client, an engine...), shared by every job of
    # the worker process; None without a lifespan. Any, as Starlette's request.state: a task
    # that wants it typed asks state_as(MyState).
    state: Any = field(default=None, repr=False, compare=False)

    def state_as(self, kind: type[S]) -> S:
        """Return :attr:`state`, checked to be a ``kind`` (typed for the caller)."""
        if not isinstance(self.state, kind):
            raise AioqError(
                f"the worker's lifespan state is a {type(self.state).__name__}, not a"
                f" {kind.__name__} (give the worker or registry a lifespan= that yields one)"
            )
        return self.state

    @property
    def is_last_attempt(self) -> bool:
        """Whether a failure now makes the job dead."""
        return self.attempt >= self.max_attempts

    @property
    def cancel_requested(self) -> bool:
        """Whether someone asked to cancel this job (for sync tasks, which cannot be interrupted).

        A sync task polls it and returns early; the job then ends ``cancelled`` whatever it
        returns. An async task is cancelled where it awaits and need not look.
        """
        return self.handle is not None and self.handle.cancel_requested

    async def upstream(self) -> dict[str, Any]:
        """Return ``{step name: result}`` of this workflow step's direct dependencies.

        A dependency that ended dead or cancelled (seen by a step added with
        ``on_failure="run"``) maps to a :class:`StepFailed`. A plain job has none: ``{}``.
        """
        if self.handle is None:
            return {}
        return await self.handle.upstream()

    async def set_progress(self, progress: float, *, note: str | None = None) -> None:
        """Store how far the job is (0 to 1) and an optional note, visible in ``get_job``.

        From a sync task (a thread): ``anyio.from_thread.run(job.set_progress, 0.5)``.
        """
        if isinstance(progress, bool) or not isinstance(progress, int | float):
            raise ConfigError("progress", f"must be a number from 0 to 1, got {progress!r}")
        if not (math.isfinite(progress) and 0 <= progress <= 1):
            raise ConfigError("progress", f"must be a number from 0 to 1, got {progress!r}")
        if note is not None:
            if not isinstance(note, str) or "\x00" in note or len(note) > MAX_PROGRESS_NOTE:
                raise ConfigError(
                    "note", f"must be text without NUL of at most {MAX_PROGRESS_NOTE} characters"
                )
            note = note.encode("utf-8", "backslashreplace").decode("utf-8")
        if self.handle is not None:
            await self.handle.set_progress(float(progress), note)


# The context of the running job, or what builds it: a worker sets a builder, since most tasks
# never ask and the context costs more to build than the rest of a job's bookkeeping.
_current: contextvars.ContextVar[JobContext | Callable[[], JobContext]] = contextvars.ContextVar(
    "aioq_current_job"
)


def current_job() -> JobContext:
    """Return the context of the job the calling task is running."""
    try:
        context = _current.get()
    except LookupError:
        raise AioqError(
            "current_job() called outside a running aioq task (to call a task in a test,"
            " wrap the call in aioq.testing.job_context())"
        ) from None
    if not isinstance(context, JobContext):
        context = context()
        _current.set(context)  # the same context for the rest of this run (reset after it)
    return context
