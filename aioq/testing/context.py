"""Call a task's function directly in a test, with the job context ``current_job()`` returns."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from aioq.job import JobContext, _current
from aioq.options import DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE
from aioq.tasks import Task

__all__ = ("job_context",)


@contextmanager
def job_context(
    *,
    id: int = 1,
    attempt: int = 1,
    max_attempts: int | None = None,
    task: Task[..., Any] | str = "test",
    queue: str | None = None,
    worker_id: str = "test-worker",
    scheduled_at: datetime | None = None,
) -> Iterator[JobContext]:
    """Make ``aioq.current_job()`` return this context inside the block; yield it.

    ``task`` may be a :class:`aioq.Task`: its name, queue and max_attempts then fill what is
    not given. ``scheduled_at`` is the tick, for a periodic task. The context is a context variable, so it reaches the ``await``s inside the block
    and a sync task called directly (or through ``anyio.to_thread.run_sync``, which copies it).
    Blocks nest; leaving one restores the context it replaced.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    if isinstance(task, Task):
        name = task.name
        queue = task.defaults.queue if queue is None else queue
        max_attempts = task.defaults.max_attempts if max_attempts is None else max_attempts
    else:
        name = task
    context = JobContext(
        id=id,
        attempt=attempt,
        max_attempts=DEFAULT_MAX_ATTEMPTS if max_attempts is None else max_attempts,
        task=name,
        queue=DEFAULT_QUEUE if queue is None else queue,
        worker_id=worker_id,
        scheduled_at=scheduled_at,
    )
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)
