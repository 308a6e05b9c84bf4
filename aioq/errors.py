"""Exceptions raised by aioq.

Every exception that crosses the public API derives from :class:`AioqError`::

    AioqError
    ├── ConfigError             a bad option or name (field, value)
    ├── DeferError              a job could not be deferred; nothing was written (task_name)
    │   ├── ArgumentError       an argument the task does not take, lacks, or whose value does
    │   │   │                   not fit its annotation (argument: the path to it)
    │   │   └── SerializationError  a value not exactly representable as JSON
    │   └── OptionError         an ``options(...)`` value out of range (also a ConfigError)
    ├── TaskError               a job failed to run in a way the worker reports (task_name, job_id)
    │   ├── UnknownTaskError    no task of that name is registered
    │   ├── PayloadError        the stored arguments cannot be decoded, bound or read as their
    │   │                       annotated types
    │   └── ResultError         the return value does not fit its annotation or JSON (a failed
    │                           attempt), or a stored one cannot be read as its annotated type
    ├── SchemaError             the schema is missing, too old, or cannot be applied
    ├── TemplateError           (also a ValueError) a statement breaks aioq.sql's template rules
    ├── StartupError            a worker could not start; nothing was claimed
    │   └── WorkerIdInUse       its worker_id is held by a live worker (worker_id)
    ├── ServerError             the embedded PostgreSQL cannot be found or started
    ├── NoResult                ``aioq.result`` has no value to return (job_id)
    │   ├── JobFailed           the job is dead (last_error)
    │   ├── JobCancelled        the job was cancelled
    │   └── ResultMissing       no result is stored: expired, never kept, or no such job
    ├── ResultTimeout           (also a TimeoutError) the job has not ended in time; left alone
    └── JobControl              raised by a task to steer its own job
        ├── Retry               run again later, without counting as an error
        └── Fail                stop retrying: the job goes straight to ``dead``
"""

from __future__ import annotations

__all__ = (
    "AioqError",
    "ArgumentError",
    "ConfigError",
    "DeferError",
    "Fail",
    "JobCancelled",
    "JobControl",
    "JobFailed",
    "NoResult",
    "OptionError",
    "PayloadError",
    "ResultError",
    "ResultMissing",
    "ResultTimeout",
    "Retry",
    "SchemaError",
    "SerializationError",
    "ServerError",
    "StartupError",
    "TaskError",
    "TemplateError",
    "UnknownTaskError",
    "WorkerIdInUse",
)

from datetime import timedelta

MAX_RETRY_DELAY = 366 * 24 * 3600.0  # a year and a day: beyond this, a retry is a mistake

MAX_DURATION = 100 * 365.25 * 86400.0
"""The longest delay, lease or schedule period, in seconds (a century): far inside PostgreSQL's
interval and timestamp range and Python's timedelta and datetime, so ``now() + delay``, ``now() +
lease`` and a schedule's tick arithmetic can never overflow."""


class AioqError(Exception):
    """Root of every error aioq raises."""

    default_message = "aioq error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.default_message)

    @property
    def message(self) -> str:
        """The human-readable message."""
        return str(self.args[0])


class StartupError(AioqError):
    """A worker could not start (its lifespan failed to open, its id is taken). Nothing was
    claimed."""

    default_message = "the worker could not start"


class WorkerIdInUse(StartupError):
    """A live worker holds this worker's id: two workers with one id would release each other's
    running jobs (docs/architecture.md, "Worker ids"). Nothing was claimed or released."""

    def __init__(self, worker_id: str, message: str) -> None:
        self.worker_id = worker_id
        super().__init__(message)


class ConfigError(AioqError, ValueError):
    """An option has a value aioq cannot use."""

    default_message = "invalid configuration"

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class DeferError(AioqError):
    """A job could not be deferred; nothing was written."""

    default_message = "could not defer the job"

    def __init__(self, task_name: str, problem: str) -> None:
        self.task_name = task_name
        super().__init__(f"cannot defer {task_name!r}: {problem}")


class ArgumentError(DeferError, TypeError):
    """The arguments given to ``defer`` do not fit the task: a name it does not take or lacks,
    or a value that does not fit its annotation or cannot be stored as JSON.

    ``argument`` is the path to the value at fault (``lines[3].sku``), or None when the
    problem is with the names."""

    def __init__(self, task_name: str, problem: str, *, argument: str | None = None) -> None:
        self.argument = argument
        super().__init__(task_name, problem)


class OptionError(DeferError, ConfigError):
    """A per-call option (``options(...)``) has a value the job could not be stored with."""

    def __init__(self, task_name: str, field: str, problem: str) -> None:
        self.task_name = task_name
        self.field = field
        self.problem = problem
        AioqError.__init__(self, f"cannot defer {task_name!r}: option {field}: {problem}")


class SerializationError(ArgumentError):
    """An argument cannot be stored as JSON and read back unchanged (an :class:`ArgumentError`:
    catch that one)."""

    def __init__(self, task_name: str, argument: str, problem: str) -> None:
        super().__init__(task_name, f"argument {argument!r} {problem}", argument=argument)


class TaskError(AioqError):
    """A job could not run; the worker records this as the job's ``last_error``."""

    default_message = "the job could not run"

    def __init__(self, task_name: str, job_id: int, problem: str) -> None:
        self.task_name = task_name
        self.job_id = job_id
        super().__init__(problem)


class UnknownTaskError(TaskError):
    """No task of the job's name is registered in the worker's registry."""


class PayloadError(TaskError):
    """The job's stored arguments cannot be decoded, do not bind to the task, or cannot be read
    as their annotated types."""


class ResultError(TaskError):
    """A task returned a value that does not fit its return annotation or cannot be stored as
    JSON (the attempt failed), or a stored result cannot be read as the annotated type."""


class SchemaError(AioqError):
    """The aioq schema is missing or cannot be installed."""

    default_message = "the aioq schema is not usable"


class TemplateError(AioqError, ValueError):
    """A statement's template breaks the rules of :mod:`aioq.sql` (raised as its module is
    imported: a bug in aioq, never a user's input)."""

    default_message = "a statement's template breaks the template rules"


class ServerError(AioqError):
    """The embedded PostgreSQL server cannot be found or started."""

    default_message = "the embedded PostgreSQL server failed"


class NoResult(AioqError):
    """``aioq.result`` cannot return a value for this job."""

    default_message = "the job has no result"

    def __init__(self, job_id: int, problem: str) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id}: {problem}")


class JobFailed(NoResult):
    """The awaited job is dead: it failed on its last attempt (``last_error`` says how)."""

    def __init__(self, job_id: int, last_error: str | None) -> None:
        self.last_error = last_error
        first = (last_error or "no error recorded").splitlines()[0]
        super().__init__(job_id, f"failed: {first}")


class JobCancelled(NoResult):
    """The awaited job was cancelled."""

    def __init__(self, job_id: int) -> None:
        super().__init__(job_id, "was cancelled")


class ResultMissing(NoResult):
    """No result is stored for the job: it expired, its task keeps none, or no such job."""


UNCOMMITTED = (
    "it was deferred in the transaction that waits for it, which has not committed, and no"
    " worker sees a job before its commit: commit, then wait for the result"
)
"""Why a job cannot end while its own, uncommitted transaction waits for it."""


class ResultTimeout(AioqError, TimeoutError):
    """The awaited job did not end within the timeout; it is left as it is."""

    def __init__(
        self, job_id: int, timeout: float, status: str, *, uncommitted: bool = False
    ) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self.status = status  # "unknown": no connection came free to read it in time
        if status == "unknown":
            message = f"job {job_id}: no connection came free to read its state within {timeout:g}s"
        else:
            message = f"job {job_id} is still {status} after {timeout:g}s"
        why = f": {UNCOMMITTED}" if uncommitted else ""
        super().__init__(message + why)


class JobControl(AioqError):
    """Base of the exceptions a task raises to steer its own job."""


class Retry(JobControl):
    """Raise from a task to run the job again after ``delay`` seconds.

    A retry requested this way does not count as a failure: the attempt is
    refunded and ``last_error`` is left as it was.
    """

    default_message = "retry requested"

    def __init__(self, delay: float | timedelta = 0.0, reason: str | None = None) -> None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        if not 0 <= seconds <= MAX_RETRY_DELAY:
            raise ConfigError(
                "delay", f"must be between 0 and {MAX_RETRY_DELAY:g} seconds, got {seconds}"
            )
        self.delay = seconds
        super().__init__(reason or f"retry requested in {seconds:g}s")


class Fail(JobControl):
    """Raise from a task to mark its job ``dead`` at once, with this message."""

    default_message = "failed by the task"
