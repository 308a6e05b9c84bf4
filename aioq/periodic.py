"""``@aioq.periodic``: put a task on a schedule (:class:`aioq.schedule.Schedule`).

Here, not in schedule.py: the decorator needs the task (its arguments' check, its options, its
registry), and the registry holds schedules, so a schedule that knew the task would make the
two modules import each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from aioq.errors import AioqError, ConfigError
from aioq.options import to_seconds
from aioq.schedule import Schedule
from aioq.tasks import Task

__all__ = ("periodic",)

T = TypeVar("T", bound=Task[..., Any])


def periodic(
    *,
    every: float | timedelta | None = None,
    cron: str | None = None,
    tz: str = "UTC",
    kwargs: Mapping[str, object] | None = None,
    catch_up: float | timedelta = 0.0,
    name: str | None = None,
) -> Callable[[T], T]:
    """Run a task on a schedule: stack ``@aioq.periodic(...)`` on top of ``@aioq.task``.

    ``every`` is seconds (or a timedelta) counted from the Unix epoch in UTC; ``cron`` a
    five-field expression in time zone ``tz`` (needs ``aioq-pg[cron]``). ``kwargs`` are the
    task's arguments for every tick. After downtime, the ticks missed within ``catch_up``
    seconds are enqueued once each; by default only the most recent one. ``name`` identifies
    the schedule (default: the task's name); give one to put a task on two schedules.
    """

    def register(task: T) -> T:
        if not isinstance(task, Task):
            raise ConfigError(
                "periodic",
                f"{getattr(task, '__qualname__', task)!r} is not a task: put @aioq.periodic"
                " above @aioq.task",
            )
        where = f"task {task.name!r}: "
        schedule = Schedule(
            name=name or task.name,
            task=task.name,
            args=_args(task, dict(kwargs or {})),
            queue=task.defaults.queue,
            priority=task.defaults.priority,
            max_attempts=task.defaults.max_attempts,
            lease=task.defaults.lease,
            every=None if every is None else to_seconds("every", every, where=where),
            cron=cron,
            tz=tz,
            catch_up=to_seconds("catch_up", catch_up, where=where),
        )
        schedules = task.registry.schedules
        old = schedules.get(schedule.name)
        if old is not None and (old.task, old.spec, old.args, old.catch_up) != (
            task.name,
            schedule.spec,
            schedule.args,
            schedule.catch_up,
        ):
            raise ConfigError(
                "name",
                f"task {task.name!r}: a schedule named {schedule.name!r} exists already;"
                " give each schedule of a task its own name=",
            )
        schedules[schedule.name] = schedule
        return task

    return register


def _args(task: Task[..., Any], kwargs: dict[str, object]) -> str:
    """The schedule's arguments checked against the task, as stored JSON."""
    where = f"task {task.name!r}"
    try:
        task.check_arguments(kwargs)
    except TypeError as exc:
        raise ConfigError("kwargs", f"{where}: {exc}") from None
    try:  # typed values by the task's annotations, as defer takes them
        return task.encode(kwargs)
    except AioqError as exc:
        raise ConfigError("kwargs", f"{where}: {exc}") from None
