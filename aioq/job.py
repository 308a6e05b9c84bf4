"""What a job is: its status, its row, the claim that fences it, and the context a task sees."""

from __future__ import annotations

import contextvars
import enum
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from aioq.errors import AioqError

__all__ = ("Claim", "ClaimKey", "Job", "JobContext", "JobStatus", "OutcomeKind", "current_job")

ClaimKey = tuple[int, int]
"""(job id, claim number): the identity of one claim, never reused."""


class JobStatus(enum.StrEnum):
    """The values of ``jobs.status``, and ``succeeded`` for a finished job in the archive."""

    PENDING = "pending"
    RUNNING = "running"
    DEAD = "dead"
    SUCCEEDED = "succeeded"


class OutcomeKind(enum.Enum):
    """What a finished attempt does to its job; the values are the metrics' outcome labels."""

    COMPLETE = "succeeded"  # the task returned: delete (or archive)
    FAIL = "retried"  # the task failed: back to pending after a backoff, error recorded
    SNOOZE = "snoozed"  # the task raised aioq.Retry: back to pending after its delay
    RELEASE = "released"  # given back unrun or unfinished (shutdown): attempt refunded
    BURY = "dead"  # failed with no attempts left, or aioq.Fail


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A job as stored, for inspection.

    A ``succeeded`` job comes from the archive, which keeps no run_at, lease, error or
    unique_key: there ``run_at`` and ``locked_at`` are when the successful attempt started,
    ``locked_by`` the worker that ran it, ``lease`` None, and ``finished_at`` is set.
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

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> Job:
        """Build a job from a row of ``GET_JOB`` / ``LIST_JOBS``."""
        values = dict(row.items())
        values["status"] = JobStatus(values["status"])
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
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

    @property
    def key(self) -> ClaimKey:
        """The identity of this claim: (job id, claim number)."""
        return (self.id, self.number)

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> Claim:
        """Build a claim from a row of the claim statement."""
        return cls(
            id=row["id"],
            number=row["claims"],
            queue=row["queue"],
            task=row["task"],
            args=row["args"],
            priority=row["priority"],
            attempt=row["attempts"],
            max_attempts=row["max_attempts"],
            lease=row["lease"],
            waited=max(0.0, row["waited"] or 0.0),
            traceparent=row["traceparent"],
            snoozes=row["snoozes"],
            scheduled_at=row["scheduled_at"],
        )


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

    @property
    def is_last_attempt(self) -> bool:
        """Whether a failure now makes the job dead."""
        return self.attempt >= self.max_attempts


_current: contextvars.ContextVar[JobContext] = contextvars.ContextVar("aioq_current_job")


def current_job() -> JobContext:
    """Return the context of the job the calling task is running."""
    try:
        return _current.get()
    except LookupError:
        raise AioqError(
            "current_job() called outside a running aioq task (to call a task in a test,"
            " wrap the call in aioq.testing.job_context())"
        ) from None
