"""Inspect and steer jobs from Python: the operations the CLI runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg

from aioq.db import Connection, Target, executor
from aioq.errors import AioqError
from aioq.job import Job, JobStatus, possible_id
from aioq.options import check_duration
from aioq.sql import DEFAULT_SCHEMA, control_channel, results_channel
from aioq.sql import admin as sql
from aioq.sql.control import CANCEL_JOBS
from aioq.sql.history import RECENT_OUTCOMES, RecentOutcomes
from aioq.sql.maintenance import PRUNE_ENDED

__all__ = (
    "QueueStats",
    "Replay",
    "Stats",
    "TableStats",
    "cancel_jobs",
    "delete_jobs",
    "get_job",
    "list_jobs",
    "purge_dead",
    "retry_dead",
    "stats",
)

DEFAULT_PURGE_BATCH = 1000


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
    expired_leases: int  # running past their lease, not yet reaped
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
class Stats:
    """A snapshot of every queue and of the jobs table."""

    queues: tuple[QueueStats, ...]
    table: TableStats
    archived: bool  # whether the archive holds completed jobs


def _completed(
    queue: str, recent: dict[str, RecentOutcomes], archived: dict[str, int]
) -> int | None:
    """A queue's completions in the last minute: the history's, else the archive's, else None."""
    if recent:
        return recent[queue].completed if queue in recent else 0
    if archived:
        return archived.get(queue, 0)
    return None


async def stats(conn: Target, *, schema: str = DEFAULT_SCHEMA) -> Stats:
    """Return per-queue counts and the jobs table's size and vacuum figures."""
    conn = await executor(conn)
    rows = await sql.QUEUE_STATS.rows(conn, schema)
    completed = {r.queue: r.completed for r in await sql.ARCHIVE_STATS.rows(conn, schema)}
    table = await sql.TABLE_STATS.row(conn, schema)
    assert table is not None  # the regclass cast raises for a missing table
    recent = {r.queue: r for r in await RECENT_OUTCOMES.rows(conn, schema)}
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
    )


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
    ids = sorted({int(i) for i in job_ids})
    channels = (control_channel(schema), results_channel(schema))
    states: dict[int, str] = dict.fromkeys((i for i in ids if not possible_id(i)), "missing")
    ids = [i for i in ids if possible_id(i)]
    for _ in range(CANCEL_RACES):
        if not ids:
            break
        found = {
            r.id: r.state for r in await CANCEL_JOBS.rows(conn, schema, ids, *channels, reason)
        }
        ids = settle_cancels(states, found)
    return cancel_outcome(states, ids)


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


async def delete_jobs(
    conn: Target, job_ids: Sequence[int], *, schema: str = DEFAULT_SCHEMA
) -> list[int]:
    """Delete jobs that are pending, dead or cancelled; return the ids deleted (running jobs
    are kept: cancel them; so are pending workflow steps, whose dependents wait for them)."""
    conn = await executor(conn)
    ids = [i for i in job_ids if possible_id(i)]
    return sorted(await sql.DELETE_JOBS.rows(conn, schema, ids)) if ids else []


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
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if older_than is not None:
        check_duration("older_than", older_than)  # before any SQL: now() - it must not overflow
    conn = await executor(conn)
    total = 0
    while True:
        deleted = await PRUNE_ENDED.row(conn, schema, older_than or 0.0, batch_size, "dead") or 0
        total += deleted
        if deleted < batch_size:
            return total


@dataclass(frozen=True, slots=True, kw_only=True)
class Replay:
    """What :func:`retry_dead` did: the jobs made pending again, and those left dead, with why."""

    retried: list[int]
    skipped: dict[int, str]  # job id -> why it stays dead (its unique_key is taken)
    # Workflow steps that a retried step's death had cancelled and that wait again (job id ->
    # step name): the run resumes.
    revived: dict[int, str] = field(default_factory=dict)


REPLAY_TRIES = 10
"""Times a replay is tried again when a concurrent defer takes one of its unique keys."""


async def retry_dead(
    conn: Target,
    *,
    job_id: int | Sequence[int] | None = None,
    task: str | None = None,
    queue: str | None = None,
    all: bool = False,
    schema: str = DEFAULT_SCHEMA,
) -> Replay:
    """Replay dead jobs (by id, task or queue; ``all=True`` for every one).

    A ``unique_key`` belongs to at most one live job: of several dead jobs sharing a key only the
    newest is replayed, and none while a live job holds it. Those are reported in ``skipped``;
    they never make the whole call fail. A workflow step brings back the steps its death
    cancelled (they wait for it again): ``revived`` names them.
    """
    if job_id is None and task is None and queue is None and not all:
        raise ValueError("retry_dead needs job_id, task, queue or all=True")
    db = await executor(conn)
    ids = [job_id] if isinstance(job_id, int) else job_id
    if ids is not None:
        ids = [i for i in ids if possible_id(i)]  # an id past bigint names no job
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as own:
            return await _replay(own, ids, task, queue, schema)
    return await _replay(db, ids, task, queue, schema)


async def _replay(
    conn: Connection, ids: Sequence[int] | None, task: str | None, queue: str | None, schema: str
) -> Replay:
    wanted = list(ids) if ids is not None else None
    for _ in range(REPLAY_TRIES):
        try:
            # A savepoint inside the caller's transaction (or a transaction of its own), so a
            # lost race leaves the caller's transaction usable.
            async with conn.transaction():
                rows = await sql.REPLAY_DEAD.rows(conn, schema, wanted, task, queue)
        except asyncpg.UniqueViolationError:
            # A job with one of the keys became live after this statement's snapshot (a defer
            # or another replay committed meanwhile); the next try sees it and skips that key.
            continue
        retried = [row.id for row in rows if row.replayed]
        skipped = {row.id: _why_skipped(row) for row in rows if not row.replayed}
        revived = {
            job_id: name
            for row in rows
            for job_id, name in zip(row.revived, row.revived_names, strict=True)
        }
        return Replay(retried=retried, skipped=skipped, revived=dict(sorted(revived.items())))
    raise AioqError(f"retry_dead: unique keys kept changing owner over {REPLAY_TRIES} tries")


def _why_skipped(row: sql.Replayed) -> str:
    key = row.unique_key
    if row.live_id is not None:
        return f"unique_key {key!r} is held by live job {row.live_id}"
    return f"unique_key {key!r} went to dead job {row.newest}, the newest with that key"


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
        # And those that kept a result (the richer row when a job is in both).
        kept = await sql.LIST_RESULT_JOBS.rows(conn, schema, task, queue, limit)
        by_id = {job.id: job for job in archived} | {job.id: job for job in kept}
        return [by_id[i] for i in sorted(by_id)[:limit]]
    return await sql.LIST_JOBS.rows(conn, schema, wanted, task, queue, limit)
