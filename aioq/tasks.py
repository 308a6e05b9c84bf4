"""Tasks: :class:`Task` (a function registered to run as a job), its typed ``defer``, its
``options(...)`` (a :class:`TaskCall`) and its ``call(...)`` (a :class:`Call`, a workflow step).

What a defer writes, and how, is :mod:`aioq.defer`; the registry that builds tasks is
:mod:`aioq.registry`; the options and their checks are :mod:`aioq.options`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Generic, Protocol, TypeVar, overload

from typing_extensions import ParamSpec

from aioq.backoff import Backoff
from aioq.db import Target
from aioq.dbapi import SyncTarget
from aioq.defer import defer_job, defer_job_sync, defer_jobs, defer_jobs_sync, jobs_insert
from aioq.errors import ArgumentError, ConfigError, DeferError, OptionError
from aioq.options import JobOptions, check_concurrency_key, check_exceptions, check_text, to_seconds
from aioq.results import DEFAULT_RESULT_TIMEOUT
from aioq.results import result as _await_result
from aioq.schedule import Schedule
from aioq.values import TaskCodec, compile_task, explain_mismatch, module_loading

__all__ = ("Call", "Home", "Task", "TaskCall")

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Home(Protocol):
    """What a task knows of the registry it belongs to (an :class:`aioq.Registry`): the schema
    its jobs live in, and the schedules ``@aioq.periodic`` adds to.

    A protocol, not the class: the registry builds tasks, so this module cannot import it
    (no import cycle, not even for an annotation: tests/test_structure.py).
    """

    schema: str
    schedules: dict[str, Schedule]


_FITTING_NAMES_CACHED = 64
_MAX_RESULT_TTL = 366 * 24 * 3600.0


class Task(Generic[P, R]):
    """A function registered to run as a job; ``defer`` enqueues a call to it."""

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str,
        registry: Home,
        options: JobOptions,
        timeout: float | None,
        retry: Backoff,
        result_ttl: float | None = None,
        retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        no_retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        concurrency_key: Callable[..., str | None] | None = None,
    ) -> None:
        check_text("name", name)
        # A failure is retried only if it is one of retry_on (None: any) and none of
        # no_retry_on; any other goes dead at once (judge() in aioq/worker/consumer.py).
        self.retry_on = check_exceptions("retry_on", retry_on)
        self.no_retry_on = check_exceptions("no_retry_on", no_retry_on)
        if concurrency_key is not None and not callable(concurrency_key):
            raise ConfigError(
                "concurrency_key",
                f"{name!r}: must be a function of the job's arguments returning the key,"
                f" got {concurrency_key!r} (a fixed key goes in options(concurrency_key=...))",
            )
        self.key_of = concurrency_key
        if result_ttl is not None and (
            isinstance(result_ttl, bool) or not isinstance(result_ttl, int | float)
            or not 0 < result_ttl <= _MAX_RESULT_TTL
        ):  # fmt: skip
            raise ConfigError(
                "result_ttl",
                f"{name!r}: must be None or seconds in (0, {_MAX_RESULT_TTL:g}], got {result_ttl!r}",
            )
        self.result_ttl = None if result_ttl is None else float(result_ttl)
        self.fn = fn
        self.name = name
        self.registry = registry
        self._call = TaskCall(self, options)  # defer and defer_many with the defaults
        self.timeout = timeout
        self.retry = retry
        self.is_async = inspect.iscoroutinefunction(fn)
        self.signature = inspect.signature(fn)
        self._fitting_names: set[frozenset[str]] = set()
        # Compiled on first use, when forward references resolve (docs/architecture.md,
        # "Values").
        self._values: TaskCodec | None = None
        for param in self.signature.parameters.values():
            if param.kind in (param.POSITIONAL_ONLY, param.VAR_POSITIONAL):
                raise ConfigError(
                    "task",
                    f"{name!r}: parameter {param.name!r} cannot be passed by keyword;"
                    " job arguments are stored as a JSON object of keyword arguments",
                )

    def __repr__(self) -> str:
        return f"<aioq.Task {self.name!r} queue={self.defaults.queue!r}>"

    def retries(self, error: BaseException) -> bool:
        """Whether a failure with this exception may be retried (attempts left aside)."""
        if self.retry_on is not None and not isinstance(error, self.retry_on):
            return False
        return self.no_retry_on is None or not isinstance(error, self.no_retry_on)

    def key_for(self, arguments: Mapping[str, object]) -> str | None:
        """The concurrency key the task's key function gives these arguments (None: none)."""
        if self.key_of is None:
            return None
        try:
            key = self.key_of(**arguments)
        except Exception as exc:
            raise DeferError(
                self.name, f"its concurrency_key function failed: {type(exc).__name__}: {exc}"
            ) from exc
        if key is None:
            return None
        try:
            return check_concurrency_key(key, where="the task's key function: ")
        except ConfigError as exc:
            raise OptionError(self.name, exc.field, exc.problem) from None

    @property
    def defaults(self) -> JobOptions:
        """The options of the jobs deferred without ``options()``."""
        return self._call.opts

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the function directly, in this process (no job)."""
        return self.fn(*args, **kwargs)

    def bind(self, args: tuple[object, ...], kwargs: Mapping[str, object]) -> dict[str, object]:
        """Check arguments' names against the signature; return them by name."""
        try:
            if not args:  # keywords only (defer_many's case): they are the arguments
                self.check_arguments(kwargs)
                return dict(kwargs)
            return self._bind_positional(args, kwargs)
        except TypeError as exc:
            raise ArgumentError(self.name, str(exc)) from None

    @property
    def codec(self) -> TaskCodec:
        """The codecs of the task's arguments and return value, compiled on first use."""
        compiled = self._values
        if compiled is None:
            compiled, unresolved = compile_task(self.name, self.fn, self.signature)
            if unresolved and module_loading(self.fn):
                return compiled  # names below the task may not exist yet: compiled again later
            if unresolved:
                logger.warning(
                    "task %r: annotations that cannot be resolved take any JSON value: %s",
                    self.name,
                    "; ".join(unresolved),
                )
            self._values = compiled
        return compiled

    def encode(self, arguments: Mapping[str, object]) -> str:
        """Check bound arguments' values against the annotations and encode them as stored
        JSON; raise ArgumentError naming the argument and the path to the value at fault."""
        compiled = self._values  # compiled already: the common case, without the property
        return (compiled or self.codec).encode(arguments)

    def _bind_positional(
        self, args: tuple[object, ...], kwargs: Mapping[str, object]
    ) -> dict[str, object]:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(explain_mismatch(self.signature, args, kwargs) or exc) from None
        arguments: dict[str, object] = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            else:
                arguments[name] = value
        return arguments

    def check_arguments(self, kwargs: Mapping[str, object]) -> None:
        """Raise TypeError, naming each wrong argument, unless the function accepts these."""
        names = frozenset(kwargs)
        if names in self._fitting_names:
            return
        try:
            self.signature.bind(**kwargs)
        except TypeError as exc:
            raise TypeError(explain_mismatch(self.signature, (), kwargs) or exc) from None
        # bind() judges names only, so one check per set of names is enough (bounded: a
        # **kwargs task could see endless sets).
        if len(self._fitting_names) < _FITTING_NAMES_CACHED:
            self._fitting_names.add(names)

    def options(
        self,
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
        lease: float | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: str | None = None,
        concurrency_key: str | None = None,
    ) -> TaskCall[P]:
        """Return this task with options for the jobs deferred through it.

        A value the job could not be stored with raises :class:`OptionError` (a DeferError and
        a ConfigError) naming the option.
        """
        changes: dict[str, Any] = {
            "queue": queue,
            "priority": priority,
            "run_at": run_at,
            "max_attempts": max_attempts,
            "unique_key": unique_key,
            "lease": lease,
            "on_conflict": on_conflict,
            "concurrency_key": concurrency_key,
        }
        try:
            if delay is not None:
                changes["delay"] = to_seconds("delay", delay)
            if unique_for is not None:
                changes["unique_for"] = to_seconds("unique_for", unique_for)
            changes = {k: v for k, v in changes.items() if v is not None}
            return TaskCall(self, replace(self.defaults, **changes))
        except ConfigError as exc:
            raise OptionError(self.name, exc.field, exc.problem) from None

    async def defer(self, conn: Target, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """Enqueue a call inside the caller's transaction (a pool: its own); return the job id."""
        return await self._call.defer(conn, *args, **kwargs)

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Call:
        """Return a call to this task, checked like ``defer``, for a workflow step."""
        return self._call.call(*args, **kwargs)

    async def defer_many(self, conn: Target, calls: Iterable[Mapping[str, object]], /) -> list[int]:
        """Enqueue many calls (keyword arguments each) in one statement; return their ids."""
        return await self._call.defer_many(conn, calls)

    def defer_sync(self, conn: SyncTarget, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """Enqueue a call from synchronous code, inside the transaction of ``conn`` (psycopg,
        Django's connection, a SQLAlchemy Session or Connection); return the job id."""
        return self._call.defer_sync(conn, *args, **kwargs)

    def defer_many_sync(
        self, conn: SyncTarget, calls: Iterable[Mapping[str, object]], /
    ) -> list[int]:
        """Enqueue many calls from synchronous code in one statement; return their ids."""
        return self._call.defer_many_sync(conn, calls)

    # An async task's R is the coroutine: the first overload unwraps it to what it returns.
    @overload
    async def result(
        self: Task[..., Coroutine[Any, Any, T]],
        db: Target,
        job_id: int,
        /,
        *,
        timeout: float | None = DEFAULT_RESULT_TIMEOUT,  # noqa: ASYNC109 (the API contract)
    ) -> T: ...

    @overload
    async def result(
        self: Task[..., T],
        db: Target,
        job_id: int,
        /,
        *,
        timeout: float | None = DEFAULT_RESULT_TIMEOUT,  # noqa: ASYNC109 (the API contract)
    ) -> T: ...

    async def result(
        self,
        db: Target,
        job_id: int,
        /,
        *,
        timeout: float | None = DEFAULT_RESULT_TIMEOUT,  # noqa: ASYNC109 (the API contract)
    ) -> Any:
        """Wait for a job of this task to end and return its value, read as the task's return
        annotation (see :func:`aioq.result`, which returns the JSON as stored)."""
        if self.result_ttl is None:
            raise ConfigError(
                "result_ttl", f"task {self.name!r} keeps no results; register it with result_ttl"
            )
        value = await _await_result(db, job_id, timeout=timeout, schema=self.registry.schema)
        return self.codec.decode_result(value, job_id)


@dataclass(frozen=True, slots=True)
class Call:
    """A call to a task with its options, checked and encoded, not yet deferred: a workflow
    step (``task.call(...)``, ``task.options(...).call(...)``)."""

    task: Task[..., Any]
    opts: JobOptions
    args: str  # the arguments, encoded as defer stores them
    concurrency_key: str | None

    def __repr__(self) -> str:
        return f"<aioq.tasks.Call {self.task.name} {self.args}>"


@dataclass(frozen=True, slots=True)
class TaskCall(Generic[P]):
    """A task with options applied, ready to defer."""

    task: Task[P, Any]
    opts: JobOptions

    def _keys(self, bound: Sequence[Mapping[str, object]]) -> list[str | None] | None:
        """Each job's concurrency key from the task's key function (None: it has none)."""
        if self.task.key_of is None or self.opts.concurrency_key is not None:
            return None
        return [self.task.key_for(arguments) for arguments in bound]

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Call:
        """Return a call with these options, checked like ``defer``, for a workflow step."""
        task, opts = self.task, self.opts
        if opts.unique_key is not None:
            raise OptionError(task.name, "unique_key", "a workflow step cannot take a unique_key")
        arguments = task.bind(args, kwargs)
        encoded = task.encode(arguments)
        key = opts.concurrency_key
        if key is None and task.key_of is not None:
            key = task.key_for(arguments)
        return Call(task, opts, encoded, key)

    async def defer(self, conn: Target, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """Enqueue a call inside the caller's transaction (a pool: its own); return the job id."""
        task, opts = self.task, self.opts
        arguments = task.bind(args, kwargs)
        encoded = task.encode(arguments)
        key = None if task.key_of is None else task.key_for(arguments)
        return await defer_job(conn, task.registry.schema, task.name, opts, encoded, key)

    async def defer_many(self, conn: Target, calls: Iterable[Mapping[str, object]], /) -> list[int]:
        """Enqueue many calls (keyword arguments each) in one statement; return their ids."""
        task, opts = self.task, self.opts
        jobs_insert(task.name, opts, ())  # refuses a unique_key before the arguments are read
        bound = [task.bind((), call) for call in calls]
        encoded = [task.encode(arguments) for arguments in bound]
        if not encoded:
            return []
        keys = self._keys(bound)
        return await defer_jobs(conn, task.registry.schema, task.name, opts, encoded, keys)

    def defer_sync(self, conn: SyncTarget, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """Enqueue a call from synchronous code, inside the transaction of ``conn``; return the
        job id (see :data:`aioq.dbapi.SyncTarget` for the connections it takes)."""
        task, opts = self.task, self.opts
        arguments = task.bind(args, kwargs)
        encoded = task.encode(arguments)
        key = None if task.key_of is None else task.key_for(arguments)
        return defer_job_sync(conn, task.registry.schema, task.name, opts, encoded, key)

    def defer_many_sync(
        self, conn: SyncTarget, calls: Iterable[Mapping[str, object]], /
    ) -> list[int]:
        """Enqueue many calls from synchronous code in one statement; return their ids."""
        task, opts = self.task, self.opts
        jobs_insert(task.name, opts, ())  # refuses a unique_key before the arguments are read
        bound = [task.bind((), call) for call in calls]
        encoded = [task.encode(arguments) for arguments in bound]
        if not encoded:
            return []
        keys = self._keys(bound)
        return defer_jobs_sync(conn, task.registry.schema, task.name, opts, encoded, keys)
