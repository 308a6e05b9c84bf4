"""Inspect and steer jobs from Python: the operations the CLI runs."""

from __future__ import annotations

from collections.abc import Sequence

from aioq.job import Job, JobStatus
from aioq.store import Executor, Store

__all__ = ("get_job", "list_jobs", "retry_dead")


async def retry_dead(
    conn: Executor,
    *,
    job_id: int | Sequence[int] | None = None,
    task: str | None = None,
    queue: str | None = None,
    all: bool = False,
    schema: str = "aioq",
) -> list[int]:
    """Replay dead jobs (by id, task or queue; ``all=True`` for every one); return their ids."""
    if job_id is None and task is None and queue is None and not all:
        raise ValueError("retry_dead needs job_id, task, queue or all=True")
    ids = [job_id] if isinstance(job_id, int) else job_id
    return await Store.for_schema(schema).replay(conn, ids=ids, task=task, queue=queue)


async def get_job(conn: Executor, job_id: int, *, schema: str = "aioq") -> Job | None:
    """Return a job still in the table (pending, running or dead), or None."""
    return await Store.for_schema(schema).get(conn, job_id)


async def list_jobs(
    conn: Executor,
    *,
    status: JobStatus | str | None = None,
    task: str | None = None,
    queue: str | None = None,
    limit: int = 100,
    schema: str = "aioq",
) -> list[Job]:
    """Return jobs matching the filters, oldest first."""
    wanted = JobStatus(status).value if status is not None else None
    return await Store.for_schema(schema).list(
        conn, status=wanted, task=task, queue=queue, limit=limit
    )
