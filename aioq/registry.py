"""The registry: the tasks a worker can run, by name, the schema their jobs live in, the
schedules ``@aioq.periodic`` adds, and the middleware and lifespan around every run.

``@aioq.task`` is :data:`default_registry`'s ``task``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TypeVar, overload

from typing_extensions import ParamSpec

from aioq.backoff import Backoff
from aioq.errors import ConfigError
from aioq.job import JobContext
from aioq.options import (
    DEFAULT_LEASE,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_PRIORITY,
    DEFAULT_QUEUE,
    JobOptions,
)
from aioq.schedule import Schedule
from aioq.sql import DEFAULT_SCHEMA, quote_schema
from aioq.tasks import Task

__all__ = (
    "Lifespan",
    "Middleware",
    "Registry",
    "check_lifespan",
    "check_middleware",
    "default_registry",
    "script_module",
    "task",
)

P = ParamSpec("P")
R = TypeVar("R")


class Registry:
    """The tasks a worker can run, by name, and the schema their jobs live in."""

    def __init__(
        self,
        *,
        schema: str = DEFAULT_SCHEMA,
        middleware: Sequence[Middleware] = (),
        lifespan: Lifespan | None = None,
    ) -> None:
        quote_schema(schema)
        self.schema = schema
        # Wrap every run of this registry's tasks in every worker, the first outermost
        # (docs/architecture.md, "Middleware and lifespan").
        self.middleware: tuple[Middleware, ...] = check_middleware(middleware)
        # Opened once per worker run, before its first claim (Worker(lifespan=) overrides it).
        self.lifespan = check_lifespan(lifespan)
        self._tasks: dict[str, Task[..., Any]] = {}
        self.schedules: dict[str, Schedule] = {}  # @aioq.periodic adds to it, by schedule name

    def __repr__(self) -> str:
        return f"<aioq.Registry schema={self.schema!r} tasks={sorted(self._tasks)}>"

    def __contains__(self, name: object) -> bool:
        return name in self._tasks

    def __iter__(self) -> Iterator[str]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, name: str) -> Task[..., Any] | None:
        """Return the task registered under ``name``, if any."""
        return self._tasks.get(name)

    def queues(self) -> tuple[str, ...]:
        """Return ``default`` and every queue a registered task names: what a worker serves."""
        named = {t.defaults.queue for t in self._tasks.values()} - {DEFAULT_QUEUE}
        return (DEFAULT_QUEUE, *sorted(named))

    def unserved(self, queues: Iterable[str]) -> list[Task[..., Any]]:
        """Return the registered tasks whose queue is not among ``queues``, by name."""
        served = set(queues)
        return [t for _, t in sorted(self._tasks.items()) if t.defaults.queue not in served]

    def add(self, new: Task[P, R]) -> Task[P, R]:
        """Register a task; a different function under a taken name is an error."""
        old = self._tasks.get(new.name)
        if old is not None and old.fn is not new.fn and _origin(old.fn) != _origin(new.fn):
            raise ConfigError("name", f"a different task is already registered as {new.name!r}")
        self._tasks[new.name] = new
        return new

    @overload
    def task(self, fn: Callable[P, R], /) -> Task[P, R]: ...

    @overload
    def task(
        self,
        *,
        name: str | None = None,
        queue: str = DEFAULT_QUEUE,
        priority: int = DEFAULT_PRIORITY,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        lease: float = DEFAULT_LEASE,
        timeout: float | None = None,
        retry: Backoff | None = None,
        result_ttl: float | None = None,
        retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        no_retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        concurrency_key: Callable[..., str | None] | None = None,
    ) -> Callable[[Callable[P, R]], Task[P, R]]: ...

    def task(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        queue: str = DEFAULT_QUEUE,
        priority: int = DEFAULT_PRIORITY,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        lease: float = DEFAULT_LEASE,
        timeout: float | None = None,
        retry: Backoff | None = None,
        result_ttl: float | None = None,
        retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        no_retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        concurrency_key: Callable[..., str | None] | None = None,
    ) -> Any:
        """Register a function as a task (as ``@registry.task`` or ``@registry.task(...)``).

        ``result_ttl`` (seconds) keeps each job's return value, as JSON, for that long after it
        succeeds, for :func:`aioq.result` and ``task.result``; without it nothing is kept.
        ``retry_on`` (an exception class or a tuple): only those failures are retried, any
        other makes the job dead at once; ``no_retry_on``: those are never retried.
        ``aioq.Retry`` and ``aioq.Fail`` work as always. ``concurrency_key``: a function of the
        job's arguments (by keyword) that returns its key (see ``aioq.admin.set_queue``'s
        ``max_running_per_key``), or None for none.
        """
        if timeout is not None and not timeout > 0:
            raise ConfigError("timeout", f"must be > 0 seconds or None, got {timeout}")
        options = JobOptions(queue=queue, priority=priority, max_attempts=max_attempts, lease=lease)

        def register(func: Callable[..., Any]) -> Task[..., Any]:
            return self.add(
                Task(
                    func,
                    name=name or _origin(func),
                    registry=self,
                    options=options,
                    timeout=timeout,
                    retry=retry or Backoff(),
                    result_ttl=result_ttl,
                    retry_on=retry_on,
                    no_retry_on=no_retry_on,
                    concurrency_key=concurrency_key,
                )
            )

        return register if fn is None else register(fn)


Middleware = Callable[[JobContext, Callable[[], Awaitable[Any]]], Awaitable[Any]]
"""``async def mw(job, call_next)``: wraps one run of a task. ``await call_next()`` runs the
rest (the next middleware, then the task) and returns its value or raises its exception; what
the middleware returns or raises is the run's outcome."""

Lifespan = Callable[[Any], AbstractAsyncContextManager[Any]]
"""``lifespan(worker)``: an async context manager (Starlette's shape) entered once per worker
run before its first claim and exited after its last outcome is written; what it yields is
``aioq.current_job().state``."""


def check_middleware(middleware: object) -> tuple[Middleware, ...]:
    """Return middleware as a tuple, or raise ConfigError unless it is a sequence of
    ``async def mw(job, call_next)`` functions."""
    if isinstance(middleware, str | bytes) or not isinstance(middleware, Sequence):
        raise ConfigError("middleware", f"must be a list of async functions, got {middleware!r}")
    for mw in middleware:
        call = getattr(mw, "__call__", None)  # noqa: B004 (an async __call__ counts)
        if not (inspect.iscoroutinefunction(mw) or inspect.iscoroutinefunction(call)):
            raise ConfigError(
                "middleware", f"each must be an async def mw(job, call_next), got {mw!r}"
            )
    return tuple(middleware)


def check_lifespan(lifespan: object) -> Lifespan | None:
    """Return a lifespan, or raise ConfigError unless it is None or callable."""
    if lifespan is not None and not callable(lifespan):
        raise ConfigError(
            "lifespan",
            f"must be a function of the worker returning an async context manager, got {lifespan!r}",
        )
    return lifespan


def _origin(fn: Callable[..., object]) -> str:
    """A task's default name: the module a worker imports it from, and its qualified name."""
    module = fn.__module__
    if module == "__main__":
        module = script_module() or module
    return f"{module}.{fn.__qualname__}"


def script_module() -> str | None:
    """The name under which ``import`` finds the script running as ``__main__``, if any.

    A task defined in a script run as ``python app/tasks.py`` has ``__module__ == "__main__"``;
    a worker started as ``aioq worker tasks`` imports the same file as ``tasks``. Both must give
    the task one name, so the script's tasks are named after its module: ``python -m pkg.mod``
    records it (``__main__.__spec__``); for a file, its stem, prefixed with the packages (the
    directories holding an ``__init__.py``) it sits in, as ``aioq worker pkg.mod`` imports it.
    None when ``__main__`` is no file (the REPL, ``python -c``, a notebook).
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        return str(spec.name)
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    file = Path(path).resolve()
    parts = [file.stem]
    folder = file.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


default_registry = Registry()
"""The registry ``@aioq.task`` registers into."""

task = default_registry.task
"""Register a function as a task in the default registry."""
