"""The job's state machine, defined once: its statuses, the events that move a job, and the
table of which event takes which status to which (docs/architecture.md, "Job states").

The statements of :mod:`aioq.sql` and the triggers of schema.sql write the statuses;
tests/test_states.py runs every one of them on a real database from every status and holds
each change it makes against :data:`TRANSITIONS`, and each transition of the table against
the statements (none is dead). The diagram in docs/architecture.md is :func:`mermaid`'s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = (
    "TRANSITIONS",
    "Event",
    "JobStatus",
    "OutcomeKind",
    "Transition",
    "mermaid",
    "table",
)


class JobStatus(enum.StrEnum):
    """The values of ``jobs.status``, and ``succeeded`` for a finished job (archive, results)."""

    PENDING = "pending"
    RUNNING = "running"
    DEAD = "dead"
    CANCELLED = "cancelled"  # kept, like dead, until dead_retention prunes it
    WAITING = "waiting"  # a workflow step whose dependencies have not all succeeded
    SUCCEEDED = "succeeded"  # not a jobs row: found in the archive or in results


class OutcomeKind(enum.Enum):
    """What a finished attempt does to its job: each is the event of that name (the values
    are the metrics' outcome labels and the words of the log)."""

    SUCCEEDED = "succeeded"  # the task returned: delete (or archive)
    RETRIED = "retried"  # the task failed: back to pending after a backoff, error recorded
    SNOOZED = "snoozed"  # the task raised aioq.Retry: back to pending after its delay
    RELEASED = "released"  # given back unrun or unfinished (shutdown): attempt refunded
    DEAD = "dead"  # failed with no attempts left, or aioq.Fail
    CANCELLED = "cancelled"  # cancelled on request: kept, never retried
    # The worker does not know the job's task (a deploy in progress): handed on to a worker
    # that does, attempt refunded, marked with when it began to wait (unknown_since).
    UNKNOWN_TASK = "unknown_task"


class Event(enum.StrEnum):
    """What moves a job from one status to another; the outcome kinds are among them."""

    DEFERRED = "deferred"  # inserted (defer, a periodic tick, a workflow's steps)
    CLAIM = "claim"  # a worker took it
    SUCCEEDED = "succeeded"
    RETRIED = "retried"
    SNOOZED = "snoozed"
    RELEASED = "released"
    DEAD = "dead"
    CANCELLED = "cancelled"
    UNKNOWN_TASK = "unknown_task"
    RESCUED = "rescued"  # the reaper took back a claim whose lease expired
    CANCEL = "cancel"  # cancel_jobs on a job that is not running (a running one: a request)
    REPLAY = "replay"  # a dead job sent back (aioq.admin.replay, `aioq jobs replay`)
    DEPENDENCIES_MET = "dependencies_met"  # a waiting step's dependencies ended as it needs
    DEPENDENCY_FAILED = "dependency_failed"  # a dependency of a waiting step ended dead/cancelled
    DEPENDENCY_REPLAYED = "dependency_replayed"  # the step that failed it was replayed
    DELETED = "deleted"  # aioq.admin.delete_jobs
    PRUNED = "pruned"  # dead_retention


@dataclass(frozen=True, slots=True)
class Transition:
    """One row of the table: ``event`` takes a job in ``source`` to ``target`` (``when`` says
    which, when the event has several targets). None is no row: before a job is deferred, and
    after it is deleted or pruned."""

    source: JobStatus | None
    event: Event
    target: JobStatus | None
    when: str = ""


_P, _R, _D, _C, _W, _S = (
    JobStatus.PENDING,
    JobStatus.RUNNING,
    JobStatus.DEAD,
    JobStatus.CANCELLED,
    JobStatus.WAITING,
    JobStatus.SUCCEEDED,
)
_CANCEL_REQUESTED = "a cancel was requested"

TRANSITIONS: tuple[Transition, ...] = (
    Transition(None, Event.DEFERRED, _P),
    Transition(None, Event.DEFERRED, _W, "a workflow step with dependencies"),
    Transition(_P, Event.CLAIM, _R),
    Transition(_R, Event.SUCCEEDED, _S),
    Transition(_R, Event.RETRIED, _P),
    Transition(_R, Event.RETRIED, _C, _CANCEL_REQUESTED),
    Transition(_R, Event.SNOOZED, _P),
    Transition(_R, Event.SNOOZED, _C, _CANCEL_REQUESTED),
    Transition(_R, Event.RELEASED, _P),
    Transition(_R, Event.RELEASED, _C, _CANCEL_REQUESTED),
    Transition(_R, Event.DEAD, _D),
    Transition(_R, Event.CANCELLED, _C),
    Transition(_R, Event.UNKNOWN_TASK, _P, "it waits for a worker that knows its task"),
    Transition(_R, Event.UNKNOWN_TASK, _C, _CANCEL_REQUESTED),
    Transition(_R, Event.RESCUED, _P, "attempts left"),
    Transition(_R, Event.RESCUED, _D, "attempts spent"),
    Transition(_R, Event.RESCUED, _C, _CANCEL_REQUESTED),
    Transition(_P, Event.CANCEL, _C),
    Transition(_W, Event.CANCEL, _C),
    Transition(_D, Event.REPLAY, _P),
    Transition(_D, Event.REPLAY, _W, "a workflow step with a dependency not succeeded"),
    Transition(_W, Event.DEPENDENCIES_MET, _P),
    Transition(_W, Event.DEPENDENCY_FAILED, _C),
    Transition(_C, Event.DEPENDENCY_REPLAYED, _W),
    Transition(_P, Event.DELETED, None),
    Transition(_D, Event.DELETED, None),
    Transition(_C, Event.DELETED, None),
    Transition(_D, Event.PRUNED, None),
    Transition(_C, Event.PRUNED, None),
)
"""Every change of a job's status: (status, event) -> status. A running job asked to cancel
stays running (its worker ends it ``cancelled``, or the rescue does); a job never leaves
``succeeded`` (its copy in results or the archive expires)."""


def mermaid() -> str:
    """The table as a Mermaid state diagram (docs/architecture.md shows it)."""
    lines = ["stateDiagram-v2"]
    for t in TRANSITIONS:
        source = "[*]" if t.source is None else t.source.value
        target = "[*]" if t.target is None else t.target.value
        label = t.event.value + (f" ({t.when})" if t.when else "")
        lines.append(f"    {source} --> {target}: {label}")
    return "\n".join(lines) + "\n"


def table() -> str:
    """The table as plain text, one line per status and event (docs/architecture.md)."""
    rows = [
        (
            "(none)" if t.source is None else t.source.value,
            t.event.value,
            "(gone)" if t.target is None else t.target.value,
            t.when,
        )
        for t in TRANSITIONS
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "".join(
        f"{s:<{width[0]}}  --{e}--> {' ' * (width[1] - len(e))}{t:<{width[2]}}"
        f"{'  if ' + w if w else ''}".rstrip()
        + "\n"
        for s, e, t, w in rows
    )
