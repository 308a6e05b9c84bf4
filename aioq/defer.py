"""Tasks: the ``@task`` decorator, typed ``defer``, per-call options and the registry."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from typing_extensions import ParamSpec

from aioq import hooks
from aioq.argcheck import ArgsChecker, compile_checker, explain_mismatch
from aioq.backoff import Backoff
from aioq.codec import encode_args
from aioq.db import Executor, Target, executor
from aioq.dbapi import SyncTarget
from aioq.dbapi import executor as sync_executor
from aioq.errors import MAX_DURATION, ArgumentError, ConfigError, DeferError, OptionError
from aioq.job import JobContext
from aioq.results import DEFAULT_RESULT_TIMEOUT
from aioq.results import result as _await_result
from aioq.schedule import Schedule
from aioq.sql import DEFAULT_SCHEMA, Statement, quote_schema
from aioq.sql import jobs as sql

__all__ = (
    "MAX_DURATION",
    "MIN_LEASE",
    "Backoff",
    "Call",
    "Registry",
    "Task",
    "TaskCall",
    "default_registry",
    "task",
)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

DEFAULT_QUEUE = "default"
DEFAULT_PRIORITY = 0
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_LEASE = 30.0
MIN_LEASE = 1.0
"""The shortest lease accepted (seconds). The heartbeat extends a claim a third of its lease
after the claim and after each extension, so a lease of one second leaves a beat 0.33 s
(two beats) of slack for a slow statement or a busy event loop; below that, a healthy
worker would lose its own jobs to another worker's reaper."""


def check_text(field: str, value: str) -> None:
    """Raise ConfigError unless a name is text PostgreSQL stores as given (no NUL, valid UTF-8)."""
    if "\x00" in value:
        raise ConfigError(
            field, f"{value!r} contains a NUL character, which PostgreSQL cannot store"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            field, f"{value!r} contains a lone surrogate, which is not valid Unicode text"
        ) from None


MAX_QUEUE_NAME = 200
"""The longest queue name, in characters."""


def check_name(field: str, value: object, longest: int) -> str:
    """Return a name, or raise ConfigError unless it is non-empty storable text of at most
    ``longest`` characters."""
    if not isinstance(value, str) or not value or len(value) > longest:
        raise ConfigError(
            field, f"must be a non-empty name of at most {longest} characters, got {value!r}"
        )
    check_text(field, value)
    return value


def check_queue(field: str, value: object) -> str:
    """Return a queue name, or raise ConfigError unless it is non-empty storable text of at
    most MAX_QUEUE_NAME characters (the one check of every queue name aioq takes)."""
    return check_name(field, value, MAX_QUEUE_NAME)


def to_seconds(field: str, value: object, *, where: str = "") -> float:
    """Return seconds given as a number or a timedelta; ConfigError naming the field otherwise.

    ``where`` prefixes the message (``"task 'x': "``). Bounds are the caller's to check.
    """
    if isinstance(value, timedelta):
        return value.total_seconds()  # a float: timedelta.max (8.6e13 s) is refused afterwards
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            field, f"{where}must be seconds or a timedelta, got {type(value).__name__}"
        )
    try:
        return float(value)
    except OverflowError:  # an int past float's range: past every bound
        raise ConfigError(
            field, f"{where}must be a number of seconds, got an integer past float's range"
        ) from None


def check_duration(
    field: str, value: object, *, minimum: float = 0.0, maximum: float = MAX_DURATION
) -> None:
    """Raise ConfigError unless ``value`` is a finite number of seconds in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(field, f"must be a number of seconds, got {type(value).__name__}")
    # Compared as they are: NaN and infinities fail, and so does an int past float's range
    # (math.isfinite would raise OverflowError on it).
    if not minimum <= value <= maximum:
        huge = isinstance(value, int) and abs(value) >= 10**30  # its repr may not even exist
        shown = "an integer past float's range" if huge else repr(value)
        raise ConfigError(
            field, f"must be finite, between {minimum:g} and {maximum:.0f} seconds; got {shown}"
        )


def check_time(field: str, value: object) -> None:
    """Raise ConfigError unless ``value`` is an aware datetime PostgreSQL can store."""
    if not isinstance(value, datetime):
        raise ConfigError(field, f"must be a datetime, got {type(value).__name__}")
    if value.utcoffset() is None:
        raise ConfigError(field, "must be an aware datetime (with tzinfo)")
    try:
        value.astimezone(UTC)  # what the driver sends; near year 1 or 9999 it overflows
    except OverflowError:
        raise ConfigError(field, f"{value.isoformat()} is out of range in UTC") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class JobOptions:
    """Where and when one deferred job runs."""

    queue: str = DEFAULT_QUEUE
    priority: int = DEFAULT_PRIORITY
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    lease: float = DEFAULT_LEASE
    delay: float = 0.0
    run_at: datetime | None = None
    unique_key: str | None = None
    # With unique_key: a defer within this many seconds of the first job's creation returns
    # that job's id, even once it has finished (docs/architecture.md, "Unique jobs").
    unique_for: float | None = None
    # With unique_key: "keep" the live job as it is, or "replace" a pending one's arguments
    # and run time.
    on_conflict: str = "keep"
    # Jobs of one key run at most the queue's max_running_per_key at once (aioq.set_queue).
    concurrency_key: str | None = None
    # Every column but queue, task and args at the table's default: INSERT_DEFAULT_JOB.
    at_defaults: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_queue("queue", self.queue)
        if self.unique_key is not None:
            check_text("unique_key", self.unique_key)
        if self.unique_for is not None:
            check_duration("unique_for", self.unique_for, minimum=MIN_UNIQUE_FOR)
            if self.unique_key is None:
                raise ConfigError("unique_for", "needs a unique_key: the key the window is for")
        if self.on_conflict not in ON_CONFLICT:
            raise ConfigError(
                "on_conflict", f"must be 'keep' or 'replace', got {self.on_conflict!r}"
            )
        if self.on_conflict != "keep" and self.unique_key is None:
            raise ConfigError("on_conflict", "needs a unique_key: the key that conflicts")
        if self.concurrency_key is not None:
            check_concurrency_key(self.concurrency_key)
        for name in ("priority", "max_attempts"):  # the driver would truncate 1.5 to 1
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(name, f"must be an integer, got {type(value).__name__}")
        if not -(2**31) <= self.priority < 2**31:
            raise ConfigError("priority", f"must fit in 32 bits, got {self.priority}")
        if not 1 <= self.max_attempts < 2**31:
            raise ConfigError("max_attempts", f"must be >= 1, got {self.max_attempts}")
        # Durations and times are checked here, before any SQL: a value PostgreSQL refuses
        # would abort the caller's transaction at defer.
        check_duration("lease", self.lease, minimum=MIN_LEASE)
        check_duration("delay", self.delay)
        if self.run_at is not None:
            check_time("run_at", self.run_at)
            if self.delay:
                raise ConfigError("run_at", "give either run_at or delay, not both")
        lean = (
            self.run_at is None
            and not self.delay
            and self.unique_key is None
            and self.concurrency_key is None
        )
        at_defaults = lean and (self.priority, self.max_attempts, self.lease) == sql.TABLE_DEFAULTS
        object.__setattr__(self, "at_defaults", at_defaults)  # frozen: set once, here


ON_CONFLICT = ("keep", "replace")
MIN_UNIQUE_FOR = 0.001
MAX_CONCURRENCY_KEY = 200
"""The longest concurrency key, in characters."""


def check_concurrency_key(value: object, *, where: str = "") -> str:
    """Return a concurrency key, or raise ConfigError unless it is non-empty storable text of at
    most MAX_CONCURRENCY_KEY characters."""
    if not isinstance(value, str) or not value or len(value) > MAX_CONCURRENCY_KEY:
        raise ConfigError(
            "concurrency_key",
            f"{where}must be a non-empty text of at most {MAX_CONCURRENCY_KEY} characters,"
            f" got {value!r}",
        )
    check_text("concurrency_key", value)
    return value


def check_exceptions(field: str, value: object) -> tuple[type[BaseException], ...] | None:
    """Return exception types as a tuple (one type or a tuple of them), None for None;
    ConfigError naming the field otherwise."""
    if value is None:
        return None
    types = value if isinstance(value, tuple) else (value,)
    if not types or not all(isinstance(t, type) and issubclass(t, BaseException) for t in types):
        raise ConfigError(
            field, f"must be an exception class or a non-empty tuple of them, got {value!r}"
        )
    return types


_FITTING_NAMES_CACHED = 64
_MAX_RESULT_TTL = 366 * 24 * 3600.0
_NO_HOOK = contextlib.nullcontext()


class Task(Generic[P, R]):
    """A function registered to run as a job; ``defer`` enqueues a call to it."""

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str,
        registry: Registry,
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
        # Compiled on the first defer, when forward references resolve; None: nothing to check.
        self._check_values: ArgsChecker | None = None
        self._checker_compiled = False
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
        """Check arguments against the signature and simple annotations; return them by name."""
        try:
            if not args:  # keywords only (defer_many's case): they are the arguments
                self.check_arguments(kwargs)
                arguments = dict(kwargs)
            else:
                arguments = self._bind_positional(args, kwargs)
        except TypeError as exc:
            raise ArgumentError(self.name, str(exc)) from None
        if not self._checker_compiled:
            self._check_values = compile_checker(self.fn, self.signature)
            self._checker_compiled = True
        check = self._check_values
        if check is not None:
            problem = check(arguments)
            if problem is not None:
                raise ArgumentError(self.name, problem)
        return arguments

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
        """Wait for a job of this task to end and return its value (see :func:`aioq.result`)."""
        if self.result_ttl is None:
            raise ConfigError(
                "result_ttl", f"task {self.name!r} keeps no results; register it with result_ttl"
            )
        return await _await_result(db, job_id, timeout=timeout, schema=self.registry.schema)


Insert = tuple[Statement[int], tuple[object, ...]]
"""A statement that inserts jobs, and its values."""

UNIQUE_TRIES = 10
"""Times an insert with a unique_key is tried while the live job holding the key keeps ending."""


def job_inserts(
    name: str,
    opts: JobOptions,
    encoded: str,
    traceparent: str | None = None,
    concurrency_key: str | None = None,
) -> Iterator[Insert]:
    """Yield the insert of one job of task ``name``, as many times as the caller may run it.

    The caller runs each until one returns an id, else raises :func:`key_kept_moving`. Only the
    insert with a unique_key can return none: the live job holding the key ended between the
    conflict and the read, and the next try sees that. Both ``defer`` and ``defer_sync`` run
    these, so a job is written the same way whatever the connection.

    ``concurrency_key``: the key the task's key function gave (the options' own comes first).
    A window (unique_for), a replace or a key takes INSERT_UNIQUE_JOB_FOR; without them the
    statements are the ones they always were.
    """
    key = opts.concurrency_key if opts.concurrency_key is not None else concurrency_key
    if opts.at_defaults and traceparent is None and key is None:  # the common case
        yield sql.INSERT_DEFAULT_JOB, (opts.queue, name, encoded)
        return
    values: tuple[object, ...] = (opts.queue, name, encoded, opts.priority, opts.run_at)
    values += (opts.delay, opts.max_attempts, opts.lease, traceparent)
    if opts.unique_key is None:
        if key is None:
            yield sql.INSERT_JOB, values
        else:
            yield sql.INSERT_KEYED_JOB, (*values, key)
        return
    plain = opts.unique_for is None and opts.on_conflict == "keep" and key is None
    replace = opts.on_conflict == "replace"
    for _ in range(UNIQUE_TRIES):
        if plain:
            yield sql.INSERT_UNIQUE_JOB, (*values, opts.unique_key)
        else:
            yield (
                sql.INSERT_UNIQUE_JOB_FOR,
                (*values, opts.unique_key, opts.unique_for, replace, key),
            )


def key_kept_moving(name: str, opts: JobOptions) -> DeferError:
    """The error of a unique_key whose live job ended at every try of :func:`job_inserts`."""
    return DeferError(name, f"unique_key {opts.unique_key!r} kept changing owner")


def jobs_insert(
    name: str,
    opts: JobOptions,
    encoded: Sequence[str],
    traceparent: str | None = None,
    keys: Sequence[str | None] | None = None,
) -> Insert:
    """The one statement that inserts many jobs of task ``name``; its ids come back in order.

    ``keys``: each job's concurrency key (None: the options' own, if any, for every job).
    """
    if opts.unique_key is not None:
        raise DeferError(name, "unique_key applies to one job; defer_many cannot use it")
    values = (opts.queue, name, opts.priority, opts.run_at, opts.delay, opts.max_attempts)
    values_ = (*values, opts.lease, list(encoded), traceparent)
    if opts.concurrency_key is not None:
        keys = [opts.concurrency_key] * len(encoded)
    if keys is None:
        return sql.INSERT_JOBS, values_
    return sql.INSERT_KEYED_JOBS, (*values_, list(keys))


async def insert_job(
    schema: str,
    conn: Executor,
    name: str,
    opts: JobOptions,
    encoded: str,
    traceparent: str | None = None,
    concurrency_key: str | None = None,
) -> int:
    """Insert one job of task ``name`` with these options and return its id (with a
    unique_key: the live job's, or the one its unique_for window remembers)."""
    for statement, values in job_inserts(name, opts, encoded, traceparent, concurrency_key):
        job_id = await statement.row(conn, schema, *values)
        if job_id is not None:
            return job_id
    raise key_kept_moving(name, opts)


@dataclass(frozen=True, slots=True)
class Call:
    """A call to a task with its options, checked and encoded, not yet deferred: a workflow
    step (``task.call(...)``, ``task.options(...).call(...)``)."""

    task: Task[..., Any]
    opts: JobOptions
    args: str  # the arguments, encoded as defer stores them
    concurrency_key: str | None

    def __repr__(self) -> str:
        return f"<aioq.Call {self.task.name} {self.args}>"


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
        encoded = encode_args(task.name, arguments)
        key = opts.concurrency_key
        if key is None and task.key_of is not None:
            key = task.key_for(arguments)
        return Call(task, opts, encoded, key)

    async def defer(self, conn: Target, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """Enqueue a call inside the caller's transaction (a pool: its own); return the job id."""
        task, opts = self.task, self.opts
        arguments = task.bind(args, kwargs)
        encoded = encode_args(task.name, arguments)
        key = None if task.key_of is None else task.key_for(arguments)
        conn = await executor(conn)
        schema = task.registry.schema
        if not hooks.observers:
            return await insert_job(schema, conn, task.name, opts, encoded, None, key)
        deferral = hooks.Deferral(task.name, opts.queue, 1)
        with hooks.deferring(deferral):
            traceparent = deferral.traceparent
            job_id = await insert_job(schema, conn, task.name, opts, encoded, traceparent, key)
            deferral.ids = (job_id,)
            return job_id

    async def defer_many(self, conn: Target, calls: Iterable[Mapping[str, object]], /) -> list[int]:
        """Enqueue many calls (keyword arguments each) in one statement; return their ids."""
        task, opts = self.task, self.opts
        jobs_insert(task.name, opts, ())  # refuses a unique_key before the arguments are read
        bound = [task.bind((), call) for call in calls]
        encoded = [encode_args(task.name, arguments) for arguments in bound]
        if not encoded:
            return []
        keys = self._keys(bound)
        conn = await executor(conn)
        deferral = hooks.Deferral(task.name, opts.queue, len(encoded))
        with hooks.deferring(deferral) if hooks.observers else _NO_HOOK:
            traceparent = deferral.traceparent
            statement, values = jobs_insert(task.name, opts, encoded, traceparent, keys)
            deferral.ids = await statement.rows(conn, task.registry.schema, *values)
            return list(deferral.ids)

    def defer_sync(self, conn: SyncTarget, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """Enqueue a call from synchronous code, inside the transaction of ``conn``; return the
        job id (see :data:`aioq.sync.SyncTarget` for the connections it takes)."""
        task, opts = self.task, self.opts
        arguments = task.bind(args, kwargs)
        encoded = encode_args(task.name, arguments)
        key = None if task.key_of is None else task.key_for(arguments)
        db = sync_executor(conn)
        deferral = hooks.Deferral(task.name, opts.queue, 1)
        with hooks.deferring(deferral) if hooks.observers else _NO_HOOK:
            traceparent = deferral.traceparent
            for statement, values in job_inserts(task.name, opts, encoded, traceparent, key):
                job_id = statement.row_sync(db, task.registry.schema, *values)
                if job_id is not None:
                    deferral.ids = (job_id,)
                    return job_id
            raise key_kept_moving(task.name, opts)

    def defer_many_sync(
        self, conn: SyncTarget, calls: Iterable[Mapping[str, object]], /
    ) -> list[int]:
        """Enqueue many calls from synchronous code in one statement; return their ids."""
        task, opts = self.task, self.opts
        jobs_insert(task.name, opts, ())  # refuses a unique_key before the arguments are read
        bound = [task.bind((), call) for call in calls]
        encoded = [encode_args(task.name, arguments) for arguments in bound]
        if not encoded:
            return []
        keys = self._keys(bound)
        db = sync_executor(conn)
        deferral = hooks.Deferral(task.name, opts.queue, len(encoded))
        with hooks.deferring(deferral) if hooks.observers else _NO_HOOK:
            traceparent = deferral.traceparent
            statement, values = jobs_insert(task.name, opts, encoded, traceparent, keys)
            deferral.ids = statement.rows_sync(db, task.registry.schema, *values)
            return list(deferral.ids)


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
        job's arguments (by keyword) that returns its key (see ``aioq.set_queue``'s
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
