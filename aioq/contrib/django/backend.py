"""aioq as the backend of Django's Tasks framework: ``enqueue`` writes an aioq job.

``TASKS = {"default": {"BACKEND": "aioq.contrib.django.AioqBackend", ...}}``. A Django task's
``enqueue()`` inserts one job on Django's connection (the ``DATABASE`` alias), so it joins the
``transaction.atomic()`` block in progress there: a rolled-back block leaves no job. The job's
task name is the Django task's module path, its arguments ``{"args": [...], "kwargs": {...}}``
(and ``"backend"``, the TASKS alias); ``aioq worker --django`` (or ``manage.py aioq worker``)
runs it, and ``get_result`` reads
Django's ``TaskResult`` back from the job, its stored result and its last error.

Each Django task gets one aioq :class:`~aioq.Task` (:meth:`AioqBackend.runner`): the same
object writes the job here and runs it in the worker, so defer's checks, statements and
options are aioq's own.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import anyio
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, close_old_connections, connections
from django.utils import timezone
from django.utils.module_loading import import_string

import aioq
from aioq.codec import decode_args, decode_result
from aioq.contrib.django.tasks import (
    BaseTaskBackend,
    DjangoTask,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
    task_enqueued,
    task_finished,
    task_started,
)
from aioq.errors import ArgumentError, ConfigError
from aioq.job import Job, JobStatus
from aioq.options import DEFAULT_LEASE, JobOptions

__all__ = (
    "DEFAULT_RESULT_TTL",
    "AioqBackend",
    "as_enqueued",
    "as_json",
    "django_json",
    "django_task",
    "result_of",
    "task_error",
)

DEFAULT_RESULT_TTL = 7 * 24 * 3600.0
"""Seconds a task's return value (and a succeeded job) stays readable by ``get_result``."""
DEFAULT_MAX_ATTEMPTS = 1
"""Django runs a task once: a task that raises is FAILED (``MAX_ATTEMPTS`` retries it)."""


class AioqBackend(BaseTaskBackend):
    """Django's Tasks on aioq: jobs in PostgreSQL, in the caller's transaction.

    ``OPTIONS``: ``DATABASE`` (the Django database alias the jobs live in; "default"),
    ``SCHEMA`` (aioq's schema; "aioq"), ``MAX_ATTEMPTS`` (1: Django's "a task that raised has
    failed"; more retries it with aioq's backoff), ``LEASE`` (seconds; 30), ``TIMEOUT``
    (seconds a run may take; none), ``RESULT_TTL`` (seconds results stay readable; 7 days).
    """

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        options = dict(self.options)
        self.database: str = options.pop("DATABASE", DEFAULT_DB_ALIAS)
        schema = options.pop("SCHEMA", aioq.sql.DEFAULT_SCHEMA)
        max_attempts = options.pop("MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS)
        lease = options.pop("LEASE", DEFAULT_LEASE)
        self.timeout: float | None = options.pop("TIMEOUT", None)
        self.result_ttl: float = options.pop("RESULT_TTL", DEFAULT_RESULT_TTL)
        if options:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]: unknown OPTIONS {sorted(options)} (aioq takes DATABASE,"
                " SCHEMA, MAX_ATTEMPTS, LEASE, TIMEOUT, RESULT_TTL)"
            )
        try:
            self.registry = aioq.Registry(schema=schema)
            self.defaults = JobOptions(max_attempts=max_attempts, lease=lease)
            if self.timeout is not None and not self.timeout > 0:
                raise ConfigError("TIMEOUT", f"must be > 0 seconds or None, got {self.timeout}")
        except ConfigError as exc:
            raise ImproperlyConfigured(f"TASKS[{alias!r}] OPTIONS: {exc}") from None

    @property
    def schema(self) -> str:
        """The schema the jobs live in."""
        return self.registry.schema

    def runner(self, task: DjangoTask) -> aioq.Task[..., Any]:
        """The aioq task that writes and runs the jobs of a Django task (made once per path)."""
        path = task.module_path
        found = self.registry.get(path)
        if found is None:
            found = self.registry.add(
                aioq.Task(
                    _async_runner(path) if task_is_async(task) else _sync_runner(path),
                    name=path,
                    registry=self.registry,
                    options=self.defaults,
                    timeout=self.timeout,
                    retry=aioq.Backoff(),
                    result_ttl=self.result_ttl,
                )
            )
        return found

    def enqueue(self, task: DjangoTask, args: Any, kwargs: Any) -> Any:
        """Write the job on Django's connection, inside its transaction; return its result."""
        self.validate_task(task)
        run_at = task.run_after
        if run_at is not None and timezone.is_naive(run_at):  # USE_TZ = False: local time
            run_at = timezone.make_aware(run_at)
        call = self.runner(task).options(
            queue=task.queue_name, priority=task.priority, run_at=run_at
        )
        args, kwargs = django_json(task.module_path, args, kwargs)
        conn = connections[self.database]
        job_id = call.defer_sync(conn, args=args, kwargs=kwargs, backend=self.alias)
        result = TaskResult(
            task=task,
            id=str(job_id),
            status=TaskResultStatus.READY,
            enqueued_at=timezone.now(),
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> Any:
        """Read a task's result from its job (pending, running, ended, or kept with its value)."""
        try:
            job_id = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(f"{result_id!r} is not an aioq job id") from None
        job = aioq.admin.get_job_sync(connections[self.database], job_id, schema=self.schema)
        if job is None:
            raise TaskResultDoesNotExist(
                f"no job {job_id} (never enqueued, or its result expired: RESULT_TTL)"
            )
        task = django_task(job.task)
        if isinstance(task, str):
            raise TaskResultDoesNotExist(f"job {job_id} is not a Django task's: {task}")
        task = as_enqueued(task, backend=self.alias, queue_name=job.queue, priority=job.priority)
        return result_of(job, task, self.alias)

    def check(self, **kwargs: Any) -> list[Any]:
        """Django's system checks: the jobs' database must be PostgreSQL."""
        from django.core import checks

        engine = settings.DATABASES.get(self.database, {}).get("ENGINE", "")
        if self.database not in settings.DATABASES:
            return [
                checks.Error(
                    f"TASKS[{self.alias!r}] OPTIONS DATABASE {self.database!r} is not in DATABASES",
                    id="aioq.E001",
                )
            ]
        if "postgresql" not in engine:
            return [
                checks.Error(
                    f"TASKS[{self.alias!r}]: aioq's jobs live in PostgreSQL; DATABASES"
                    f"[{self.database!r}] is {engine}",
                    id="aioq.E002",
                )
            ]
        return []


def django_json(path: str, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """A Django task's arguments as Django's contract stores them: JSON, round-tripped.

    Django's ``normalize_json`` comes first (tuples become lists, bytes text); then each value
    becomes the exact JSON type a JSON round trip gives back, as Django's database backends
    store it: an ``IntEnum``, ``IntegerChoices`` or ``TextChoices`` member becomes its int or
    str value, a dict key its text. Django's "Unsupported type" error is raised again as an
    :class:`aioq.ArgumentError` naming the task and the argument (a TypeError, as Django's).
    """

    def one(name: str, value: Any) -> Any:
        try:
            return as_json(normalize_json(value))
        except (TypeError, ValueError) as exc:
            raise ArgumentError(
                path,
                f"argument {name!r} cannot be a Django task's argument: {exc} (Django's Tasks"
                " take JSON values; an aioq task takes typed ones: see docs/django.md)",
                argument=name,
            ) from None

    positional = [one(f"args[{i}]", value) for i, value in enumerate(args)]
    return positional, {str(name): one(str(name), value) for name, value in dict(kwargs).items()}


def as_json(value: Any) -> Any:
    """A normalised value with the exact JSON types ``json.loads(json.dumps(value))`` gives:
    subclasses of str, int and float (enums, Django's choices) as their base values, dict keys
    as text."""
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is int or kind is float:
        return value
    if isinstance(value, dict):
        return {_key(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_json(v) for v in value]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    raise TypeError(f"Unsupported type: {kind}")


def _key(key: Any) -> str:
    """A dict key as JSON writes it (json.dumps: True is "true", None "null", 1 "1")."""
    if isinstance(key, str):
        return str.__str__(key)
    if key is None or isinstance(key, bool):
        return json.dumps(key)
    if isinstance(key, int):
        return str(int.__index__(key))
    if isinstance(key, float):
        return json.dumps(float.__float__(key))
    raise TypeError(f"Unsupported type for a key: {type(key)}")


def task_is_async(task: DjangoTask) -> bool:
    """Whether the Django task's function is a coroutine function."""
    from inspect import iscoroutinefunction

    return iscoroutinefunction(task.func)


_MODULE_PATH = re.compile(r"(?!\d)\w+(\.(?!\d)\w+)+")  # dotted identifiers


def django_task(path: str) -> DjangoTask | str:
    """The Django task at a module path, or why there is none (``get_result``'s message).

    Imports the task's module if this process has not, as Django's own backends do: the caller
    asked for this job's result. A name that is no module path is none, never an exception.
    """
    if not _MODULE_PATH.fullmatch(path):
        return f"{path!r} is not a module path"
    try:
        found = import_string(path)
    except ImportError as exc:
        return f"cannot import {path!r}: {exc}"
    if not isinstance(found, Task):
        return f"{path!r} is a {type(found).__name__}, not a Django task (decorate it with @task)"
    return found


def declared(path: str) -> tuple[object, str | None]:
    """What a job's task path names among what the project declared, importing nothing: the
    object at ``path`` in a module this process has already imported (each installed app's
    ``tasks`` module and what it imports, the worker's MODULE) and None; or None and why not.

    Never imports (a module's import runs its code: a job must not choose what runs) and never
    raises, whatever the name.
    """
    if not _MODULE_PATH.fullmatch(path):
        return None, f"{path[:200]!r} is not a module path"
    module_name, _, name = path.rpartition(".")
    module = sys.modules.get(module_name)
    if module is None:
        return None, (
            f"module {module_name!r} is not loaded: the worker runs the tasks of each installed"
            " app's tasks module (and what it imports) and of its MODULE, and imports no module"
            " a job names"
        )
    try:
        namespace = vars(module)  # not getattr: a module's __getattr__ would run its code
    except TypeError:
        return None, f"{module_name!r} is not a module"
    found = namespace.get(name)
    if found is None:
        return None, f"module {module_name!r} has no {name!r}"
    return found, None


def as_enqueued(task: DjangoTask, **changes: Any) -> DjangoTask:
    """The Django task as its job was enqueued (``using()``: another backend, queue, priority).

    Not ``using()`` itself: the task was validated when it was enqueued, and in a worker or a
    ``get_result`` the module's task may name another backend whose queues differ.
    """
    import dataclasses

    clone = object.__new__(type(task))
    for field in dataclasses.fields(task):
        object.__setattr__(clone, field.name, changes.get(field.name, getattr(task, field.name)))
    return clone


# --- running a Django task in an aioq worker ------------------------------------------------


def _current(path: str, backend: str) -> DjangoTask:
    """The Django task to run for the current job, as it was enqueued (the worker found it
    declared before it made this runner: never imported here)."""
    task, why = declared(path)
    if not isinstance(task, Task):
        raise aioq.Fail(why or f"{path!r} is not a Django task")
    return as_enqueued(task, backend=backend, queue_name=aioq.current_job().queue)


def _started(task: DjangoTask, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The TaskResult a running task sees (its context) and Django's signals carry."""
    job = aioq.current_job()
    now = timezone.now()
    return TaskResult(
        task=task,
        id=str(job.id),
        status=TaskResultStatus.RUNNING,
        enqueued_at=None,
        started_at=now,
        finished_at=None,
        last_attempted_at=now,
        args=args,
        kwargs=kwargs,
        backend=task.backend,
        errors=[],
        worker_ids=[job.worker_id] * job.attempt,
    )


def _finished(result: Any, status: Any) -> None:
    object.__setattr__(result, "status", status)
    object.__setattr__(result, "finished_at", timezone.now())


def _sync_runner(path: str) -> Callable[..., Any]:
    def run(args: list[Any], kwargs: dict[str, Any], backend: str = "default") -> Any:
        """Run a sync Django task in a worker thread, its DB connections as a request's."""
        task = _current(path, backend)
        close_old_connections()  # what Django does at a request's start (request_started)
        try:
            result = _started(task, args, kwargs)
            task_started.send(type(task.get_backend()), task_result=result)
            call_args = [TaskContext(task_result=result), *args] if task.takes_context else args
            try:
                value = as_json(normalize_json(task.func(*call_args, **kwargs)))
            except BaseException:
                _finished(result, TaskResultStatus.FAILED)
                task_finished.send(type(task.get_backend()), task_result=result)
                raise
            _finished(result, TaskResultStatus.SUCCESSFUL)
            task_finished.send(type(task.get_backend()), task_result=result)
            return value
        finally:
            close_old_connections()  # and at its end (request_finished), in the same thread

    return run


def _async_runner(path: str) -> Callable[..., Any]:
    async def run(args: list[Any], kwargs: dict[str, Any], backend: str = "default") -> Any:
        """Run an async Django task on the worker's loop, its ORM calls in a thread of its own.

        As Django's ASGI handler does per request: a ThreadSensitiveContext gives this run's
        sync_to_async calls (the async ORM's) their own thread, hence their own connection, and
        close_old_connections runs in that thread at the start and the end.
        """
        task = _current(path, backend)
        async with ThreadSensitiveContext():
            await sync_to_async(close_old_connections)()
            try:
                result = _started(task, args, kwargs)
                sender = type(task.get_backend())
                await task_started.asend(sender, task_result=result)
                call_args = [TaskContext(task_result=result), *args] if task.takes_context else args
                try:
                    value = as_json(normalize_json(await task.func(*call_args, **kwargs)))
                except BaseException:
                    _finished(result, TaskResultStatus.FAILED)
                    with anyio.CancelScope(shield=True):
                        await task_finished.asend(sender, task_result=result)
                    raise
                _finished(result, TaskResultStatus.SUCCESSFUL)
                await task_finished.asend(sender, task_result=result)
                return value
            finally:
                with anyio.CancelScope(shield=True):  # also when the run is cancelled
                    await sync_to_async(close_old_connections)()

    return run


# --- TaskResult from a job (decisions, no I/O) ------------------------------------------------

_STATUS = {
    JobStatus.PENDING: TaskResultStatus.READY,  # waiting, or waiting to be retried
    JobStatus.RUNNING: TaskResultStatus.RUNNING,
    JobStatus.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    JobStatus.DEAD: TaskResultStatus.FAILED,
    JobStatus.CANCELLED: TaskResultStatus.FAILED,  # Django has no cancelled state
}


def result_of(job: Job, task: DjangoTask, alias: str) -> Any:
    """Django's TaskResult of an aioq job of a Django task."""
    status = _STATUS[job.status]
    payload = decode_args(job.args)
    errors = [task_error(job.last_error)] if job.last_error else []
    if job.status is JobStatus.CANCELLED:
        errors.append(TaskError(exception_class_path="aioq.errors.JobCancelled", traceback=""))
    ended = job.status in (JobStatus.DEAD, JobStatus.CANCELLED)
    worker = job.locked_by or job.last_worker
    result = TaskResult(
        task=task,
        id=str(job.id),
        status=status,
        enqueued_at=job.created_at,
        started_at=job.locked_at,
        # dead and cancelled jobs keep when they ended in run_at (the pruner's clock)
        finished_at=job.finished_at or (job.run_at if ended else None),
        last_attempted_at=job.locked_at,
        args=payload.get("args", []),
        kwargs=payload.get("kwargs", {}),
        backend=alias,
        errors=errors,
        # aioq keeps the latest worker only: it stands for each attempt
        worker_ids=[worker] * job.attempts if worker else [],
    )
    if job.status is JobStatus.SUCCEEDED and job.result is not None:
        object.__setattr__(result, "_return_value", decode_result(job.result))
    return result


_HEAD = re.compile(r"^(?P<type>[A-Za-z_][\w.]*): ")


def task_error(last_error: str) -> Any:
    """Django's TaskError of an aioq ``last_error`` ("Type: message", then the traceback).

    The head names the exception by its qualified name only; the traceback's last line that
    names it gives its module (Python writes ``module.Type: message`` there).
    """
    head = _HEAD.match(last_error)
    if head is None:
        return TaskError(exception_class_path="builtins.Exception", traceback=last_error)
    name = head["type"]
    named = re.compile(rf"^((?:[A-Za-z_]\w*\.)*){re.escape(name)}(?::|$)")
    for line in reversed(last_error.splitlines()[1:]):
        found = named.match(line)
        if found:
            module = found[1].rstrip(".") or "builtins"
            return TaskError(exception_class_path=f"{module}.{name}", traceback=last_error)
    # No traceback: a failure the worker recorded itself (aioq's own errors, a timeout).
    module = "aioq.errors" if name in aioq.errors.__all__ else "builtins"
    return TaskError(exception_class_path=f"{module}.{name}", traceback=last_error)
