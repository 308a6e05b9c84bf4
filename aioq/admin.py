"""Inspect and steer a queue from Python: the operations the CLI and the dashboard run.

Every operation is a coroutine taking what :meth:`aioq.Task.defer` takes (an asyncpg connection
or pool, a SQLAlchemy ``AsyncConnection`` or ``AsyncSession``), and has a ``_sync`` twin with
the same parameters taking a synchronous connection (psycopg 3 or 2, Django's ``connection``, a
SQLAlchemy ``Session`` or ``Connection``: :data:`aioq.dbapi.SyncTarget`), which runs the same
statements inside that connection's transaction and answers alike (tests/test_admin.py holds
every operation to its twin):

==============================  ============================================================
jobs                            :func:`get_job`, :func:`list_jobs`, :func:`cancel_jobs`,
                                :func:`replay`, :func:`delete_jobs`, :func:`purge_dead`
queues                          :func:`stats`, :func:`queues`, :func:`set_queue`,
                                :func:`ring` (jobs inserted with raw SQL)
workflow runs                   :func:`list_workflows`, :func:`cancel_workflow`
the schema                      :func:`schema_sql` (the script a migration tool applies)
==============================  ============================================================

The queue limits' and the workflows' operations are defined beside their concept
(:mod:`aioq.limits`, :mod:`aioq.workflows`), the doorbell's in :mod:`aioq.doorbell`; this module
is where an operator finds them all. Reading one's own work from application code stays at the
top level: :func:`aioq.result` and :func:`aioq.workflow`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg

from aioq.db import Connection, Target, executor
from aioq.dbapi import SyncExecutor, SyncTarget, sqlstate
from aioq.dbapi import executor as sync_executor
from aioq.doorbell import ring, ring_sync
from aioq.errors import AioqError
from aioq.job import Job, JobStatus, possible_id
from aioq.limits import UNSET, QueueInfo, queues, queues_sync, set_queue, set_queue_sync
from aioq.migrate import schema_sql
from aioq.options import check_duration
from aioq.sql import DEFAULT_SCHEMA, control_channel, results_channel
from aioq.sql import admin as sql
from aioq.sql.control import CANCEL_JOBS
from aioq.sql.history import RECENT_OUTCOMES, RecentOutcomes
from aioq.sql.maintenance import PRUNE_ENDED
from aioq.sql.workflows import WORKFLOW_JOBS
from aioq.workflows import WorkflowInfo, WorkflowStep, list_workflows, list_workflows_sync

__all__ = (
    "UNSET",
    "Job",
    "JobStatus",
    "QueueInfo",
    "QueueStats",
    "Replay",
    "Stats",
    "TableStats",
    "UnknownTask",
    "WorkflowInfo",
    "WorkflowStep",
    "cancel_jobs",
    "cancel_jobs_sync",
    "cancel_workflow",
    "cancel_workflow_sync",
    "delete_jobs",
    "delete_jobs_sync",
    "get_job",
    "get_job_sync",
    "list_jobs",
    "list_jobs_sync",
    "list_workflows",
    "list_workflows_sync",
    "purge_dead",
    "purge_dead_sync",
    "queues",
    "queues_sync",
    "replay",
    "replay_sync",
    "ring",
    "ring_sync",
    "schema_sql",
    "set_queue",
    "set_queue_sync",
    "stats",
    "stats_sync",
)

DEFAULT_PURGE_BATCH = 1000


# -- a job ------------------------------------------------------------------------------------


async def get_job(conn: Target, job_id: int, *, schema: str = DEFAULT_SCHEMA) -> Job | None:
    """Return a job: pending, running, dead, cancelled, or ``succeeded`` (kept); else None.

    A succeeded job is found while its result is kept (tasks with ``result_ttl``; ``result``
    is the value as JSON text) or, when workers keep completed jobs (``keep_completed=True``),
    in the archive until pruned after ``archive_retention``. ``progress`` and
    ``progress_note`` are as the task last reported them.
    """
    if not possible_id(job_id):
        return None  # no job has it (and the driver would refuse to send it)
    conn = await executor(conn)
    found = await sql.GET_JOB.row(conn, schema, job_id)
    return found if found is not None else await sql.GET_ARCHIVED_JOB.row(conn, schema, job_id)


def get_job_sync(conn: SyncTarget, job_id: int, *, schema: str = DEFAULT_SCHEMA) -> Job | None:
    """Return a job, as :func:`get_job` does, from synchronous code."""
    if not possible_id(job_id):
        return None
    db = sync_executor(conn)
    found = sql.GET_JOB.row_sync(db, schema, job_id)
    return found if found is not None else sql.GET_ARCHIVED_JOB.row_sync(db, schema, job_id)


async def list_jobs(
    conn: Target,
    *,
    status: JobStatus | str | None = None,
    task: str | None = None,
    queue: str | None = None,
    limit: int = 100,
    schema: str = DEFAULT_SCHEMA,
) -> list[Job]:
    """Return jobs matching the filters, oldest first (``succeeded``: archive and results)."""
    conn = await executor(conn)
    wanted = JobStatus(status).value if status is not None else None
    if wanted == JobStatus.SUCCEEDED:
        archived = await sql.LIST_ARCHIVED_JOBS.rows(conn, schema, task, queue, limit)
        kept = await sql.LIST_RESULT_JOBS.rows(conn, schema, task, queue, limit)
        return _succeeded(archived, kept, limit)
    return await sql.LIST_JOBS.rows(conn, schema, wanted, task, queue, limit)


def list_jobs_sync(
    conn: SyncTarget,
    *,
    status: JobStatus | str | None = None,
    task: str | None = None,
    queue: str | None = None,
    limit: int = 100,
    schema: str = DEFAULT_SCHEMA,
) -> list[Job]:
    """Return jobs matching the filters, as :func:`list_jobs` does, from synchronous code."""
    db = sync_executor(conn)
    wanted = JobStatus(status).value if status is not None else None
    if wanted == JobStatus.SUCCEEDED:
        archived = sql.LIST_ARCHIVED_JOBS.rows_sync(db, schema, task, queue, limit)
        kept = sql.LIST_RESULT_JOBS.rows_sync(db, schema, task, queue, limit)
        return _succeeded(archived, kept, limit)
    return sql.LIST_JOBS.rows_sync(db, schema, wanted, task, queue, limit)


def _succeeded(archived: list[Job], kept: list[Job], limit: int) -> list[Job]:
    """Succeeded jobs from the archive and those that kept a result (the richer row when a
    job is in both), oldest first."""
    by_id = {job.id: job for job in archived} | {job.id: job for job in kept}
    return [by_id[i] for i in sorted(by_id)[:limit]]


# -- cancel -----------------------------------------------------------------------------------

CANCEL_STATES = ("cancelled", "cancelling", "finished", "dead", "missing")
CANCEL_RACES = 10
"""Times a cancel asks again about a job that changed while its statement ran."""


async def cancel_jobs(
    conn: Target,
    job_ids: Sequence[int],
    *,
    reason: str | None = None,
    schema: str = DEFAULT_SCHEMA,
) -> dict[int, str]:
    """Cancel jobs wherever they are; return each id's state after the call.

    ``"cancelled"``: it was pending (or scheduled), or was cancelled before, and never runs;
    ``"cancelling"``: it is running, and its worker, on whatever host, cancels the run and
    records ``cancelled`` (within about a second, or one heartbeat interval when it missed the
    notification) unless the run ends first, which then keeps its real outcome; ``"finished"``:
    it succeeded (found in the results or the archive); ``"dead"``; ``"missing"``: no such job,
    or it succeeded leaving no trace (no ``result_ttl``, no ``keep_completed``). Idempotent:
    a second call changes nothing. Cancelled jobs are kept, like dead ones, until pruned.
    ``reason``: recorded as the ``last_error`` of the jobs it cancels or asks to cancel.
    """
    conn = await executor(conn)
    channels = (control_channel(schema), results_channel(schema))
    states, ids = _cancel_ids(job_ids)
    for _ in range(CANCEL_RACES):
        if not ids:
            break
        found = {
            r.id: r.state for r in await CANCEL_JOBS.rows(conn, schema, ids, *channels, reason)
        }
        ids = settle_cancels(states, found)
    return cancel_outcome(states, ids)


def cancel_jobs_sync(
    conn: SyncTarget,
    job_ids: Sequence[int],
    *,
    reason: str | None = None,
    schema: str = DEFAULT_SCHEMA,
) -> dict[int, str]:
    """Cancel jobs wherever they are, as :func:`cancel_jobs` does, from synchronous code."""
    db = sync_executor(conn)
    channels = (control_channel(schema), results_channel(schema))
    states, ids = _cancel_ids(job_ids)
    for _ in range(CANCEL_RACES):
        if not ids:
            break
        found = {r.id: r.state for r in CANCEL_JOBS.rows_sync(db, schema, ids, *channels, reason)}
        ids = settle_cancels(states, found)
    return cancel_outcome(states, ids)


def _cancel_ids(job_ids: Sequence[int]) -> tuple[dict[int, str], list[int]]:
    """The ids a cancel asks about, in order; those past bigint are missing without asking."""
    ids = sorted({int(i) for i in job_ids})
    states: dict[int, str] = dict.fromkeys((i for i in ids if not possible_id(i)), "missing")
    return states, [i for i in ids if possible_id(i)]


def settle_cancels(states: dict[int, str], found: Mapping[int, str]) -> list[int]:
    """Record the settled states of one cancel statement in ``states``; return the ids to ask
    about again.

    'raced': the job changed while the statement ran; a fresh snapshot tells what it is.
    """
    states.update((i, state) for i, state in found.items() if state != "raced")
    return [i for i, state in found.items() if state == "raced"]


def cancel_outcome(states: dict[int, str], raced: Sequence[int]) -> dict[int, str]:
    """The states of a cancel call, by id; a job still racing after every try is finishing."""
    return dict(sorted({**states, **dict.fromkeys(raced, "finished")}.items()))


async def cancel_workflow(
    conn: Target, workflow_id: int, /, *, schema: str = DEFAULT_SCHEMA
) -> dict[int, str]:
    """Cancel a run: its waiting and pending steps at once, a cancel request to its running
    ones (see :func:`cancel_jobs`); return each live step's state by job id.

    Each step it cancels says why in its ``last_error``: ``cancelled: workflow run N
    cancelled``. An id no run can have (outside bigint) cancels nothing: ``{}``."""
    if not possible_id(workflow_id):
        return {}
    db = await executor(conn)
    ids = await WORKFLOW_JOBS.rows(db, schema, workflow_id)
    reason = cancelled_reason(workflow_id)
    return await cancel_jobs(db, ids, reason=reason, schema=schema) if ids else {}


def cancel_workflow_sync(
    conn: SyncTarget, workflow_id: int, /, *, schema: str = DEFAULT_SCHEMA
) -> dict[int, str]:
    """Cancel a run, as :func:`cancel_workflow` does, from synchronous code."""
    if not possible_id(workflow_id):
        return {}
    ids = WORKFLOW_JOBS.rows_sync(sync_executor(conn), schema, workflow_id)
    reason = cancelled_reason(workflow_id)
    return cancel_jobs_sync(conn, ids, reason=reason, schema=schema) if ids else {}


def cancelled_reason(workflow_id: int) -> str:
    """The last_error of the steps of a cancelled run."""
    return f"cancelled: workflow run {workflow_id} cancelled"


# -- replay, delete, purge --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Replay:
    """What :func:`replay` did: the jobs made pending again, and those not replayed, with why."""

    replayed: list[int]
    # Job id -> why it was not replayed: a dead job whose unique_key is taken, or (asked for by
    # id) a workflow step cancelled because a step it needs ended dead or cancelled.
    skipped: dict[int, str]
    # Workflow steps that a replayed step's death had cancelled and that wait again (job id ->
    # step name): the run resumes.
    revived: dict[int, str] = field(default_factory=dict)

    @property
    def retried(self) -> list[int]:
        """The jobs made pending again: :attr:`replayed`'s old name, kept for one release."""
        warnings.warn("Replay.retried is now Replay.replayed", DeprecationWarning, stacklevel=2)
        return self.replayed


REPLAY_TRIES = 10
"""Times a replay is tried again when a concurrent defer takes one of its unique keys."""

UNIQUE_VIOLATION = "23505"
NO_ACTIVE_TRANSACTION = "25P01"  # a SAVEPOINT outside a transaction block


async def replay(
    conn: Target,
    *,
    job_id: int | Sequence[int] | None = None,
    task: str | None = None,
    queue: str | None = None,
    all: bool = False,
    schema: str = DEFAULT_SCHEMA,
) -> Replay:
    """Send dead jobs back to pending (by id, task or queue; ``all=True`` for every one).

    A ``unique_key`` belongs to at most one live job: of several dead jobs sharing a key only the
    newest is replayed, and none while a live job holds it. Those are reported in ``skipped``;
    they never make the whole call fail. A workflow step brings back the steps its death
    cancelled (they wait for it again): ``revived`` names them. A cancelled job is not
    replayed (a cancel says it never runs); a workflow step asked for by id that was cancelled
    because a step it needs failed is in ``skipped``, naming the step whose replay revives it.
    """
    ids = _replay_ids(job_id, task, queue, all)
    db = await executor(conn)
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as own:
            return await _replay(own, ids, task, queue, schema)
    return await _replay(db, ids, task, queue, schema)


async def _replay(
    conn: Connection, ids: list[int] | None, task: str | None, queue: str | None, schema: str
) -> Replay:
    for _ in range(REPLAY_TRIES):
        try:
            # A savepoint inside the caller's transaction (or a transaction of its own), so a
            # lost race leaves the caller's transaction usable.
            async with conn.transaction():
                rows = await sql.REPLAY.rows(conn, schema, ids, task, queue)
        except asyncpg.UniqueViolationError:
            # A job with one of the keys became live after this statement's snapshot (a defer
            # or another replay committed meanwhile); the next try sees it and skips that key.
            continue
        others = _not_matched(ids, rows)
        blocked = await sql.BLOCKED_STEPS.rows(conn, schema, others) if others else []
        return _replayed(rows, blocked)
    raise _replay_kept_losing()


def replay_sync(
    conn: SyncTarget,
    *,
    job_id: int | Sequence[int] | None = None,
    task: str | None = None,
    queue: str | None = None,
    all: bool = False,
    schema: str = DEFAULT_SCHEMA,
) -> Replay:
    """Send dead jobs back to pending, as :func:`replay` does, from synchronous code.

    In the connection's transaction, each try runs under a savepoint, so a lost race on a
    unique key leaves that transaction usable; outside one (autocommit), each try is a
    transaction of its own.
    """
    ids = _replay_ids(job_id, task, queue, all)
    db = sync_executor(conn)
    savepoint = _savepoint(db, schema)
    for _ in range(REPLAY_TRIES):
        try:
            rows = sql.REPLAY.rows_sync(db, schema, ids, task, queue)
        except Exception as exc:
            if sqlstate(exc) != UNIQUE_VIOLATION:
                raise
            # As in replay(): a key became live after the statement's snapshot; try again.
            if savepoint:
                sql.ROLLBACK_TO_SAVEPOINT.rows_sync(db, schema)
            continue
        if savepoint:
            sql.RELEASE_SAVEPOINT.rows_sync(db, schema)
        others = _not_matched(ids, rows)
        blocked = sql.BLOCKED_STEPS.rows_sync(db, schema, others) if others else []
        return _replayed(rows, blocked)
    if savepoint:
        sql.RELEASE_SAVEPOINT.rows_sync(db, schema)
    raise _replay_kept_losing()


def _savepoint(db: SyncExecutor, schema: str) -> bool:
    """Set a savepoint in the caller's transaction; False when there is none (autocommit)."""
    try:
        sql.SAVEPOINT.rows_sync(db, schema)
    except Exception as exc:
        if sqlstate(exc) == NO_ACTIVE_TRANSACTION:
            return False  # nothing to protect: each statement commits on its own
        raise
    return True


def _replay_ids(
    job_id: int | Sequence[int] | None, task: str | None, queue: str | None, all: bool
) -> list[int] | None:
    """The ids a replay matches (None: any), those past bigint left out (they name no job)."""
    if job_id is None and task is None and queue is None and not all:
        raise ValueError("replay needs job_id, task, queue or all=True")
    if job_id is None:
        return None
    ids = [job_id] if isinstance(job_id, int) else job_id
    return [i for i in ids if possible_id(i)]


def _not_matched(ids: list[int] | None, rows: list[sql.Replayed]) -> list[int]:
    """The ids asked for that matched no dead job: a cancelled step among them may say why."""
    matched = {row.id for row in rows}
    return sorted({i for i in ids or () if i not in matched})


def _replayed(rows: list[sql.Replayed], blocked: list[sql.BlockedStep]) -> Replay:
    replayed = [row.id for row in rows if row.replayed]
    skipped = {row.id: _why_skipped(row) for row in rows if not row.replayed}
    skipped |= {step.id: _why_blocked(step) for step in blocked}
    revived = {
        job_id: name
        for row in rows
        for job_id, name in zip(row.revived, row.revived_names, strict=True)
    }
    return Replay(
        replayed=replayed,
        skipped=dict(sorted(skipped.items())),
        revived=dict(sorted(revived.items())),
    )


def _why_blocked(step: sql.BlockedStep) -> str:
    """Why a workflow step that a failed dependency cancelled is not replayed, from its state
    (never from its last_error's text): what brings it back, if anything."""
    failed = f"step {step.name!r} (job {step.failed})" if step.name else f"job {step.failed}"
    if step.status == "dead":
        return (
            f"cancelled because {failed}, which it needs, ended dead: replay job {step.failed}"
            " instead, and the steps it cancelled wait again"
        )
    if step.status == "cancelled":
        return (
            f"cancelled because {failed}, which it needs, was cancelled: a cancelled job is not"
            " replayed, nor the steps its cancel cancelled"
        )
    return f"cancelled because {failed}, which it needs, ended and is {step.status} now"


def _replay_kept_losing() -> AioqError:
    return AioqError(f"replay: unique keys kept changing owner over {REPLAY_TRIES} tries")


def _why_skipped(row: sql.Replayed) -> str:
    key = row.unique_key
    if row.live_id is not None:
        return f"unique_key {key!r} is held by live job {row.live_id}"
    return f"unique_key {key!r} went to dead job {row.newest}, the newest with that key"


async def delete_jobs(
    conn: Target, job_ids: Sequence[int], *, schema: str = DEFAULT_SCHEMA
) -> list[int]:
    """Delete jobs that are pending, dead or cancelled; return the ids deleted (running jobs
    are kept: cancel them; so are pending workflow steps, whose dependents wait for them)."""
    conn = await executor(conn)
    ids = [i for i in job_ids if possible_id(i)]
    return sorted(await sql.DELETE_JOBS.rows(conn, schema, ids)) if ids else []


def delete_jobs_sync(
    conn: SyncTarget, job_ids: Sequence[int], *, schema: str = DEFAULT_SCHEMA
) -> list[int]:
    """Delete jobs, as :func:`delete_jobs` does, from synchronous code."""
    db = sync_executor(conn)
    ids = [i for i in job_ids if possible_id(i)]
    return sorted(sql.DELETE_JOBS.rows_sync(db, schema, ids)) if ids else []


async def purge_dead(
    conn: Target,
    *,
    older_than: float | None = None,
    batch_size: int = DEFAULT_PURGE_BATCH,
    schema: str = DEFAULT_SCHEMA,
) -> int:
    """Delete dead jobs (that died over ``older_than`` seconds ago), in batches.

    Each batch is its own statement, so no statement runs long or holds many row locks.
    Returns how many were deleted.
    """
    _check_purge(older_than, batch_size)
    conn = await executor(conn)
    total = 0
    while True:
        deleted = await PRUNE_ENDED.row(conn, schema, older_than or 0.0, batch_size, "dead") or 0
        total += deleted
        if deleted < batch_size:
            return total


def purge_dead_sync(
    conn: SyncTarget,
    *,
    older_than: float | None = None,
    batch_size: int = DEFAULT_PURGE_BATCH,
    schema: str = DEFAULT_SCHEMA,
) -> int:
    """Delete dead jobs in batches, as :func:`purge_dead` does, from synchronous code."""
    _check_purge(older_than, batch_size)
    db = sync_executor(conn)
    total = 0
    while True:
        deleted = PRUNE_ENDED.row_sync(db, schema, older_than or 0.0, batch_size, "dead") or 0
        total += deleted
        if deleted < batch_size:
            return total


def _check_purge(older_than: float | None, batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if older_than is not None:
        check_duration("older_than", older_than)  # before any SQL: now() - it must not overflow


# -- statistics -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueStats:
    """What one queue holds now; ages in seconds of database time."""

    queue: str
    ready: int
    scheduled: int
    running: int
    dead: int
    cancelled: int  # cancelled before they ran, or while running; kept until dead_retention
    oldest_ready_age: float
    expired_leases: int  # running past their lease, not yet rescued
    # From the workers' per-minute history, as the dashboard reads it (the last full minute and
    # the current one, as far as the workers wrote it: once a stats_interval): None when no
    # worker wrote any history (stats_history off) and completed jobs are not archived either
    # (then completions are counted in the archive).
    completed_last_minute: int | None
    failed_last_minute: int | None = None  # None when no worker wrote any history
    waiting: int = 0  # workflow steps waiting for their dependencies (not claimable)


@dataclass(frozen=True, slots=True, kw_only=True)
class TableStats:
    """Size and vacuum health of the jobs table."""

    table_bytes: int
    index_bytes: int
    live_tuples: int | None
    dead_tuples: int | None
    last_autovacuum: datetime | None
    last_vacuum: datetime | None


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownTask:
    """Jobs of a task no worker that claimed them knows (a deploy in progress): they wait for a
    worker that knows it, their attempts unspent, each until a worker's unknown_task_grace from
    when it was first found unknown (docs/architecture.md, "Unknown tasks")."""

    queue: str
    task: str
    jobs: int
    since: datetime  # when the first of them was found unknown


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
    """A snapshot of every queue and of the jobs table."""

    queues: tuple[QueueStats, ...]
    table: TableStats
    archived: bool  # whether the archive holds completed jobs
    # Jobs waiting for a worker that knows their task, per queue and task (also counted in
    # their queue's ready or scheduled jobs).
    unknown_tasks: tuple[UnknownTask, ...] = ()


async def stats(conn: Target, *, schema: str = DEFAULT_SCHEMA) -> Stats:
    """Return per-queue counts and the jobs table's size and vacuum figures."""
    conn = await executor(conn)
    rows = await sql.QUEUE_STATS.rows(conn, schema)
    completed = await sql.ARCHIVE_STATS.rows(conn, schema)
    table = await sql.TABLE_STATS.row(conn, schema)
    recent = await RECENT_OUTCOMES.rows(conn, schema)
    unknown = await sql.UNKNOWN_TASKS.rows(conn, schema)
    return _stats(rows, completed, table, recent, unknown)


def stats_sync(conn: SyncTarget, *, schema: str = DEFAULT_SCHEMA) -> Stats:
    """Return per-queue counts and the jobs table's figures, as :func:`stats` does, from
    synchronous code."""
    db = sync_executor(conn)
    rows = sql.QUEUE_STATS.rows_sync(db, schema)
    completed = sql.ARCHIVE_STATS.rows_sync(db, schema)
    table = sql.TABLE_STATS.row_sync(db, schema)
    recent = RECENT_OUTCOMES.rows_sync(db, schema)
    unknown = sql.UNKNOWN_TASKS.rows_sync(db, schema)
    return _stats(rows, completed, table, recent, unknown)


def _stats(
    rows: list[sql.QueueCounts],
    completed_rows: list[sql.QueueCompleted],
    table: sql.TableFigures | None,
    recent_rows: list[RecentOutcomes],
    unknown: list[sql.UnknownTaskJobs],
) -> Stats:
    assert table is not None  # the regclass cast raises for a missing table
    completed = {r.queue: r.completed for r in completed_rows}
    recent = {r.queue: r for r in recent_rows}
    archived = bool(completed)
    names = sorted({row.queue for row in rows} | set(completed) | set(recent))
    by_queue = {row.queue: row for row in rows}
    queues = []
    for name in names:
        row = by_queue.get(name)
        queues.append(
            QueueStats(
                queue=name,
                ready=row.ready if row else 0,
                scheduled=row.scheduled if row else 0,
                running=row.running if row else 0,
                dead=row.dead if row else 0,
                cancelled=row.cancelled if row else 0,
                oldest_ready_age=row.oldest_ready_age if row else 0.0,
                expired_leases=row.expired if row else 0,
                waiting=row.waiting if row else 0,
                completed_last_minute=_completed(name, recent, completed),
                failed_last_minute=(recent[name].failed if name in recent else 0)
                if recent
                else None,
            )
        )
    return Stats(
        queues=tuple(queues),
        table=TableStats(
            table_bytes=table.table_bytes,
            index_bytes=table.index_bytes,
            live_tuples=table.n_live_tup,
            dead_tuples=table.n_dead_tup,
            last_autovacuum=table.last_autovacuum,
            last_vacuum=table.last_vacuum,
        ),
        archived=archived,
        unknown_tasks=tuple(
            UnknownTask(queue=u.queue, task=u.task, jobs=u.jobs, since=u.since) for u in unknown
        ),
    )


def _completed(
    queue: str, recent: dict[str, RecentOutcomes], archived: dict[str, int]
) -> int | None:
    """A queue's completions in the last minute: the history's, else the archive's, else None."""
    if recent:
        return recent[queue].completed if queue in recent else 0
    if archived:
        return archived.get(queue, 0)
    return None
