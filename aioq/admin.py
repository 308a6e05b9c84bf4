"""Inspect and steer jobs from Python: the operations the CLI runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from aioq.job import Job, JobStatus
from aioq.queries import DEFAULT_SCHEMA
from aioq.store import Store, Target, executor

__all__ = (
    "QueueStats",
    "Stats",
    "TableStats",
    "cancel_jobs",
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
    oldest_ready_age: float
    expired_leases: int  # running past their lease, not yet reaped
    completed_last_minute: int | None  # None unless completed jobs are archived


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
    archived: bool  # whether the archive holds completed jobs (else completions are n/a)


async def stats(conn: Target, *, schema: str = DEFAULT_SCHEMA) -> Stats:
    """Return per-queue counts and the jobs table's size and vacuum figures."""
    conn = await executor(conn)
    store = Store.for_schema(schema)
    rows = await store.queue_stats(conn)
    completed = await store.archive_stats(conn)
    table = await store.table_stats(conn)
    archived = bool(completed)
    names = sorted({row["queue"] for row in rows} | set(completed))
    by_queue = {row["queue"]: row for row in rows}
    queues = []
    for name in names:
        row = by_queue.get(name)
        queues.append(
            QueueStats(
                queue=name,
                ready=row["ready"] if row else 0,
                scheduled=row["scheduled"] if row else 0,
                running=row["running"] if row else 0,
                dead=row["dead"] if row else 0,
                oldest_ready_age=row["oldest_ready_age"] if row else 0.0,
                expired_leases=row["expired"] if row else 0,
                completed_last_minute=completed.get(name, 0) if archived else None,
            )
        )
    return Stats(
        queues=tuple(queues),
        table=TableStats(
            table_bytes=table["table_bytes"],
            index_bytes=table["index_bytes"],
            live_tuples=table["n_live_tup"],
            dead_tuples=table["n_dead_tup"],
            last_autovacuum=table["last_autovacuum"],
            last_vacuum=table["last_vacuum"],
        ),
        archived=archived,
    )


async def cancel_jobs(
    conn: Target, job_ids: Sequence[int], *, schema: str = DEFAULT_SCHEMA
) -> list[int]:
    """Delete jobs that are still pending; return the ids deleted (running or dead are kept)."""
    conn = await executor(conn)
    return list(await Store.for_schema(schema).cancel(conn, job_ids))


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
    conn = await executor(conn)
    store = Store.for_schema(schema)
    total = 0
    while True:
        deleted = await store.prune_dead(conn, older_than or 0.0, batch_size)
        total += deleted
        if deleted < batch_size:
            return total


async def retry_dead(
    conn: Target,
    *,
    job_id: int | Sequence[int] | None = None,
    task: str | None = None,
    queue: str | None = None,
    all: bool = False,
    schema: str = DEFAULT_SCHEMA,
) -> list[int]:
    """Replay dead jobs (by id, task or queue; ``all=True`` for every one); return their ids."""
    if job_id is None and task is None and queue is None and not all:
        raise ValueError("retry_dead needs job_id, task, queue or all=True")
    conn = await executor(conn)
    ids = [job_id] if isinstance(job_id, int) else job_id
    return await Store.for_schema(schema).replay(conn, ids=ids, task=task, queue=queue)


async def get_job(conn: Target, job_id: int, *, schema: str = DEFAULT_SCHEMA) -> Job | None:
    """Return a job: pending, running or dead, or ``succeeded`` from the archive; else None.

    Finished jobs are deleted unless workers keep them (``keep_completed=True``); then they
    are found here until pruned after ``archive_retention``.
    """
    conn = await executor(conn)
    store = Store.for_schema(schema)
    found = await store.get(conn, job_id)
    return found if found is not None else await store.get_archived(conn, job_id)


async def list_jobs(
    conn: Target,
    *,
    status: JobStatus | str | None = None,
    task: str | None = None,
    queue: str | None = None,
    limit: int = 100,
    schema: str = DEFAULT_SCHEMA,
) -> list[Job]:
    """Return jobs matching the filters, oldest first (``succeeded``: from the archive)."""
    conn = await executor(conn)
    wanted = JobStatus(status).value if status is not None else None
    store = Store.for_schema(schema)
    if wanted == JobStatus.SUCCEEDED:
        return await store.list_archived(conn, task=task, queue=queue, limit=limit)
    return await store.list_jobs(conn, status=wanted, task=task, queue=queue, limit=limit)
