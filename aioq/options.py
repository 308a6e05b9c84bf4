"""A job's options and the checks of every value aioq stores: names, durations, times, keys.

:class:`JobOptions` is where and when one deferred job runs (a task's defaults, or
``task.options(...)``); the ``check_*`` functions are the one check of each kind of value,
shared by tasks, the worker's config, queue limits and the admin functions, so a value
PostgreSQL would refuse raises :class:`aioq.errors.ConfigError` before any SQL runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from aioq.errors import MAX_DURATION, ConfigError
from aioq.sql import jobs as sql

__all__ = (
    "DEFAULT_LEASE",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_PRIORITY",
    "DEFAULT_QUEUE",
    "MAX_CONCURRENCY_KEY",
    "MAX_DURATION",
    "MAX_QUEUE_NAME",
    "MAX_UNIQUE_KEY",
    "MIN_LEASE",
    "ON_CONFLICT",
    "JobOptions",
    "check_concurrency_key",
    "check_duration",
    "check_exceptions",
    "check_name",
    "check_queue",
    "check_text",
    "check_time",
    "check_unique_key",
    "to_seconds",
)

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
    # Jobs of one key run at most the queue's max_running_per_key at once (aioq.admin.set_queue).
    concurrency_key: str | None = None
    # Every column but queue, task and args at the table's default: INSERT_DEFAULT_JOB.
    at_defaults: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_queue("queue", self.queue)
        if self.unique_key is not None:
            check_unique_key(self.unique_key)
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


MAX_UNIQUE_KEY = 512
"""The longest unique key, in characters: at most 2 048 bytes of UTF-8, so that a key fits the
btree entries of the indexes that hold it (jobs_unique_key_idx and the uniques table's primary
key, a key alone in each), which take at most 2 692 bytes of text on 8 kB pages; past it the
insert fails and aborts the caller's transaction. A longer key is hashed first."""


def check_unique_key(value: object) -> str:
    """Return a unique key, or raise ConfigError unless it is storable text of at most
    MAX_UNIQUE_KEY characters (the index that keeps it unique holds no longer one)."""
    if not isinstance(value, str):
        raise ConfigError("unique_key", f"must be text, got {type(value).__name__}")
    if len(value) > MAX_UNIQUE_KEY:
        raise ConfigError(
            "unique_key",
            f"must be at most {MAX_UNIQUE_KEY} characters (the unique index's entries hold"
            f" no more), got {len(value)}: use a hash of a longer key, e.g."
            " hashlib.sha256(key.encode()).hexdigest()",
        )
    check_text("unique_key", value)
    return value


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
