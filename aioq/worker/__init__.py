"""The worker: its configuration and lifecycle. What one run does is :mod:`aioq.worker.run`.

A worker is one supervisor with one asyncpg pool, one LISTEN connection and one anyio task
group; docs/architecture.md, "Inside a worker"."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal, TypedDict, TypeVar

import anyio
import asyncpg
from anyio.abc import TaskGroup, TaskStatus
from typing_extensions import Unpack

from aioq.db import Connection
from aioq.errors import ConfigError, StartupError
from aioq.metrics import Metrics
from aioq.migrate import check_installed
from aioq.options import DEFAULT_QUEUE, check_duration, check_queue
from aioq.registry import (
    Lifespan,
    Middleware,
    Registry,
    check_lifespan,
    check_middleware,
    default_registry,
)
from aioq.sql import DEFAULT_SCHEMA, quote_schema
from aioq.worker.claimer import DEFAULT_REFRESH
from aioq.worker.health import Health, judge_health
from aioq.worker.history import DEFAULT_STATS_INTERVAL, DEFAULT_STATS_RETENTION
from aioq.worker.identity import KEEPALIVES, IdHold, Release
from aioq.worker.run import Run
from aioq.worker.service import Service

__all__ = ("Worker", "WorkerConfig", "WorkerOptions")

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 10
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_HEARTBEAT_INTERVAL = 5.0
# Claimed ahead of free consumers: without it c10 drained in waves of one claim round trip.
# "auto" claims what the consumers will start within one claim round trip (ClaimAhead in
# aioq/worker/producer.py) and gives back what then waits behind long jobs, so that a claimed-ahead job
# never waits for this worker while another one is idle (Celery's prefetch trap).
DEFAULT_PREFETCH: int | Literal["auto"] = "auto"
DEFAULT_REAPER_INTERVAL = 5.0
DEFAULT_REAPER_BATCH = 1000
# Inside Kubernetes' default 30 s termination grace, with room for what follows it: the
# final outcome write and the release of what is left (bounded at 10 s, usually well under a
# second). docs/architecture.md, "Health".
DEFAULT_SHUTDOWN_GRACE = 20.0
# How long the closing of a lifespan may take before the worker gives up on it.
LIFESPAN_CLOSE = 10.0
# The start line names at most this many tasks that a worker given its queues leaves out.
_UNSERVED_NAMED = 5
# A claim takes every free slot up to this: at concurrency 1 000 a cap of 100 was the bend of
# the I/O-bound drain (each claim filled the cap, so jobs/s <= 100 / claim round trip, about
# 80 % of the ideal), and fewer, larger claims cost PostgreSQL a quarter less CPU per job.
DEFAULT_CLAIM_BATCH = 1000
DEFAULT_COMPLETION_BATCH = 1000
DEFAULT_ARCHIVE_RETENTION = 7 * 24 * 3600.0
# A workflow run's steps, edges and results, once none of its steps is left in the jobs table.
DEFAULT_WORKFLOW_RETENTION = 24 * 3600.0
DEFAULT_PRUNE_INTERVAL = 60.0
DEFAULT_PRUNE_BATCH = 1000
# Every statement of the worker's connections gives up after this long. Without it a
# connection that goes silent (a stalled proxy, a network path that drops packets without a
# reset) hangs its caller forever: the claim, the heartbeat and the completer all wait on it.
DEFAULT_COMMAND_TIMEOUT = 30.0
# Vacuum the jobs table past this many dead tuples (about half as many jobs: a claim and a
# completion each leave one), checked every DEFAULT_VACUUM_INTERVAL seconds.
DEFAULT_VACUUM_THRESHOLD = 50_000
DEFAULT_VACUUM_INTERVAL = 5.0
# Connections of the worker's own pool: claims, completions, heartbeats and the maintenance
# loops take one each for one statement at a time. The LISTEN connection comes on top.
POOL_SIZE = 4
# Warn when the event loop wakes up this late (a task blocking it).
DEFAULT_LAG_THRESHOLD = 1.0
# How long a job whose task this worker does not know waits for a worker that knows it, from
# when a worker first found it unknown (docs/architecture.md, "Unknown tasks"). An hour: longer
# than a rolling deploy takes (minutes) or stays paused half-way, so no job is lost to a
# deploy; short enough that a job no worker will ever run (its task removed, or misspelt in a
# raw insert) is dead, visible and replayable, within the hour rather than waiting for ever.
DEFAULT_UNKNOWN_TASK_GRACE = 3600.0
# The shortest interval or timeout a worker accepts: below a millisecond a loop would spin.
MIN_INTERVAL = 0.001

S = TypeVar("S", bound=Service[Any])


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    """How a worker runs; every duration is in seconds."""

    # None: "default" and every queue the registry's tasks name.
    queues: tuple[str, ...] | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    schema: str | None = None  # None: the registry's schema (aioq's default, DEFAULT_SCHEMA)
    poll_interval: float = DEFAULT_POLL_INTERVAL
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    reaper_interval: float = DEFAULT_REAPER_INTERVAL
    reaper_batch: int = DEFAULT_REAPER_BATCH
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    claim_batch: int = DEFAULT_CLAIM_BATCH
    # Jobs claimed ahead of free consumers, so the next claim's round trip overlaps the running
    # jobs (short jobs: more throughput). They wait in the worker under its heartbeat and are
    # released on a stop. "auto": as many as the consumers start within one claim round trip
    # (none for long jobs), given back when they wait behind long ones; N: always N ahead;
    # 0: claim only for free consumers.
    prefetch: int | Literal["auto"] = DEFAULT_PREFETCH
    completion_batch: int = DEFAULT_COMPLETION_BATCH
    keep_completed: bool = False
    # Retention (None keeps rows forever): archived jobs by finished_at, dead jobs by run_at.
    archive_retention: float | None = DEFAULT_ARCHIVE_RETENTION
    dead_retention: float | None = None
    # Workflow runs by created_at, once none of their steps is left in the jobs table.
    workflow_retention: float | None = DEFAULT_WORKFLOW_RETENTION
    prune_interval: float = DEFAULT_PRUNE_INTERVAL
    prune_batch: int = DEFAULT_PRUNE_BATCH
    # None leaves the jobs table to autovacuum alone.
    vacuum_threshold: int | None = DEFAULT_VACUUM_THRESHOLD
    vacuum_interval: float = DEFAULT_VACUUM_INTERVAL
    listen: bool = True
    # The per-minute history and the workers row the dashboard and `aioq stats` read.
    stats_history: bool = True
    stats_interval: float = DEFAULT_STATS_INTERVAL
    stats_retention: float = DEFAULT_STATS_RETENTION
    # PgBouncer in transaction mode: no prepared-statement cache on the pool, and LISTEN
    # through listen_dsn (a direct connection), since a pooler cannot hold a LISTEN.
    statement_cache: bool = True
    listen_dsn: str | None = None
    command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT
    # None turns the loop-lag monitor off.
    lag_threshold: float | None = DEFAULT_LAG_THRESHOLD
    # Enqueue the ticks of the registry's @aioq.periodic schedules (every worker may: the
    # database keeps it to one job per tick).
    periodic: bool = True
    # How often the worker reads which of its queues have limits (aioq.admin.set_queue).
    limits_refresh: float = DEFAULT_REFRESH
    # How long a job whose task this worker does not know waits for a worker that knows it
    # (0: dead at once), its attempts unspent; then this worker makes it dead.
    unknown_task_grace: float = DEFAULT_UNKNOWN_TASK_GRACE
    # Unique among the live workers of a database: a worker releases every row that carries
    # its id when it starts and when it stops. A given id is held for the run (one live worker
    # per id: aioq.worker.identity); a generated one is unique by construction.
    worker_id: str = field(default_factory=lambda: _default_worker_id())

    def __post_init__(self) -> None:
        if self.schema is not None:
            quote_schema(self.schema)
        if self.queues is not None and not self.queues:
            raise ConfigError("queues", "must name at least one queue, got none")
        for queue in self.queues or ():
            check_queue("queues", queue)
        for name in (
            "concurrency",
            "reaper_batch",
            "claim_batch",
            "completion_batch",
            "prune_batch",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        if self.prefetch != "auto" and (
            not isinstance(self.prefetch, int)
            or isinstance(self.prefetch, bool)
            or self.prefetch < 0
        ):
            raise ConfigError(
                "prefetch", f"must be 'auto' or an integer >= 0, got {self.prefetch!r}"
            )
        if self.vacuum_threshold is not None and (
            not isinstance(self.vacuum_threshold, int)
            or isinstance(self.vacuum_threshold, bool)
            or self.vacuum_threshold < 1
        ):
            raise ConfigError(
                "vacuum_threshold",
                f"must be None or an integer >= 1, got {self.vacuum_threshold!r}",
            )
        # Loop intervals and timeouts: finite (an infinite poll never wakes, NaN compares
        # false everywhere) and within MAX_DURATION, so `now() - retention` cannot overflow.
        for name in (
            "poll_interval",
            "heartbeat_interval",
            "reaper_interval",
            "prune_interval",
            "vacuum_interval",
            "stats_interval",
            "stats_retention",
            "limits_refresh",
        ):
            check_duration(name, getattr(self, name), minimum=MIN_INTERVAL)
        for name in ("command_timeout", "lag_threshold"):  # None: off
            if getattr(self, name) is not None:
                check_duration(name, getattr(self, name), minimum=MIN_INTERVAL)
        for name in ("archive_retention", "dead_retention", "workflow_retention"):  # None: kept
            if getattr(self, name) is not None:
                check_duration(name, getattr(self, name))
        check_duration("shutdown_grace", self.shutdown_grace)
        check_duration("unknown_task_grace", self.unknown_task_grace)
        if not self.worker_id:
            raise ConfigError("worker_id", "must not be empty")


class WorkerOptions(TypedDict, total=False):
    """The options ``Worker(...)`` takes by keyword: :class:`WorkerConfig`'s fields, so that
    ``mypy --strict`` refuses a misspelt or mistyped one (tests/test_api.py holds the two to
    the same names and types). ``queues`` may also be one name or any sequence of names."""

    queues: str | Sequence[str] | None
    concurrency: int
    schema: str | None
    poll_interval: float
    heartbeat_interval: float
    reaper_interval: float
    reaper_batch: int
    shutdown_grace: float
    claim_batch: int
    prefetch: int | Literal["auto"]
    completion_batch: int
    keep_completed: bool
    archive_retention: float | None
    dead_retention: float | None
    workflow_retention: float | None
    prune_interval: float
    prune_batch: int
    vacuum_threshold: int | None
    vacuum_interval: float
    listen: bool
    stats_history: bool
    stats_interval: float
    stats_retention: float
    statement_cache: bool
    listen_dsn: str | None
    command_timeout: float | None
    lag_threshold: float | None
    periodic: bool
    limits_refresh: float
    unknown_task_grace: float
    worker_id: str


async def _keep_session(connection: asyncpg.Connection) -> None:
    """Skip asyncpg's reset on release: a second round trip per statement.

    The pool runs only aioq's statements, which leave no session state behind (no LISTEN,
    advisory locks, cursors or SET); asyncpg still rolls back a transaction left open.
    """


class _GeneratedId(str):
    """A worker id the worker made itself (host, pid, random): unique without a hold."""

    __slots__ = ()


def _default_worker_id() -> str:
    return _GeneratedId(f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}")


class Worker:
    """Runs the jobs of a registry's tasks from the given queues.

    ``await worker.run()`` serves until cancelled or :meth:`stop`; ``async with worker:``
    serves in the background and stops gracefully on exit; ``await worker.run_until_idle()``
    returns once no job is ready or running. A worker may run again once a run has ended
    (``run_until_idle()`` again and again, as tests do), never twice at once. Without
    ``queues`` it serves ``default`` and every queue its registry's tasks name. It opens a pool
    of its own from ``dsn``, or borrows ``pool`` (an application's, never closed here; ``dsn``
    then serves only LISTEN).

    Options come as a :class:`WorkerConfig` (``config=``), as keyword arguments naming its
    fields, or both (the keywords override the config's fields). The schema, unless given,
    is the registry's.

    ``middleware``: ``async def mw(job, call_next)`` functions around every run, after the
    registry's. ``lifespan``: ``lifespan(worker)``, an async context manager opened before the
    first claim and closed after the last outcome is written; what it yields is
    ``aioq.current_job().state``. It replaces the registry's; if it fails to open, the run
    raises :class:`aioq.errors.StartupError` and claims nothing.
    """

    def __init__(
        self,
        *,
        dsn: str | None = None,
        pool: asyncpg.Pool | None = None,
        registry: Registry | None = None,
        config: WorkerConfig | None = None,
        metrics: Metrics | None = None,
        middleware: Sequence[Middleware] = (),
        lifespan: Lifespan | None = None,
        **options: Unpack[WorkerOptions],
    ) -> None:
        self.registry = registry if registry is not None else default_registry
        # The registry's middleware first (outermost), then the worker's; the worker's lifespan
        # instead of the registry's (docs/architecture.md, "Middleware and lifespan").
        self.middleware = (*self.registry.middleware, *check_middleware(middleware))
        self.lifespan = check_lifespan(lifespan) or self.registry.lifespan
        given: dict[str, Any] = dict(options)
        queues = given.get("queues")
        if isinstance(queues, str):
            given["queues"] = (queues,)
        elif queues is not None:
            given["queues"] = tuple(queues)
        for name in ("queues", "schema"):  # None: the registry's (below)
            if given.get(name) is None:
                given.pop(name, None)
        config = replace(config, **given) if config is not None else WorkerConfig(**given)
        # No queues given: serve every queue the registry's tasks name.
        self.queues_given = config.queues is not None
        if config.queues is None:
            config = replace(config, queues=self.registry.queues())
        if config.schema is None:
            config = replace(config, schema=self.registry.schema)
        self.config = config
        self.queues: tuple[str, ...] = config.queues or (DEFAULT_QUEUE,)
        self.schema: str = config.schema or DEFAULT_SCHEMA
        if dsn is None and (pool is None or (config.listen and not config.listen_dsn)):
            raise ConfigError(
                "dsn",
                "a worker needs dsn= (with pool=, for its one LISTEN connection; or give"
                " listen_dsn=, or listen=False to rely on polling)",
            )
        self.dsn = dsn or ""
        # An application's pool (pool=) is used as it is and never closed by the worker.
        self.pool = pool
        self.id = self.config.worker_id
        self.metrics = metrics
        self.stopping = anyio.Event()
        self.stopped = anyio.Event()
        self.current: Run | None = None  # the run going on, or the last one
        self._running = False
        self._tg: TaskGroup | None = None

    def __repr__(self) -> str:
        return f"<aioq.Worker {self.id} queues={list(self.queues)}>"

    def service(self, kind: type[S]) -> S:
        """Return the current run's service of a type (``worker.service(Heartbeat)``)."""
        for service in self.current.services if self.current is not None else ():
            if isinstance(service, kind):
                return service
        raise LookupError(f"this worker runs no {kind.__name__}")

    def health(self) -> Health:
        """Return whether this worker is live and ready, and why (what ``aioq worker
        --health-port`` serves on /livez and /readyz; docs/architecture.md, "Health")."""
        run = self.current if self._running else None
        now = time.monotonic()
        if run is None:
            return judge_health(
                started=False,
                stopping=self.stopping.is_set(),
                listening=None,
                answered_at=None,
                started_at=None,
                loop_lag=0.0,
                now=now,
            )
        listener = run.listener
        return judge_health(
            started=run.serving,
            stopping=self.stopping.is_set(),
            listening=None if listener is None else listener.connected.is_set(),
            answered_at=run.probe.answered_at,
            started_at=run.began,
            loop_lag=run.probe.woke_late,
            now=now,
        )

    def stop(self) -> None:
        """Stop claiming; running jobs get ``shutdown_grace`` seconds, then are released.

        The one way a run ends gracefully: ``async with`` exit, run_until_idle and signals
        all come through here. A stop before a run makes that run stop at once.
        """
        if self.current is not None and self._running:
            self.current.stop()
        else:
            self.stopping.set()

    async def run(self) -> None:
        """Serve until cancelled or stopped."""
        await self._serve(until_idle=False)

    async def run_until_idle(self) -> None:
        """Serve until no job is ready, running or waiting to be written; then stop."""
        await self._serve(until_idle=True)

    async def __aenter__(self) -> Worker:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._serve_started)
        except BaseException as exc:
            failed = exc
            try:
                await self._tg.__aexit__(type(exc), exc, exc.__traceback__)
            except BaseExceptionGroup as group:
                if group.split(lambda e: e is failed)[1] is not None:
                    raise
            raise  # the start-up error plain (no schema, no server), as run() raises it
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self.stop()
        assert self._tg is not None
        tg, self._tg = self._tg, None
        if exc is not None and not isinstance(exc, anyio.get_cancelled_exc_class()):
            # The body's own exception goes to the caller as it is: handed to the task
            # group, it would come back wrapped in an ExceptionGroup. The worker stops
            # gracefully meanwhile.
            await tg.__aexit__(None, None, None)
            return None
        return await tg.__aexit__(exc_type, exc, tb)

    async def _serve_started(self, *, task_status: TaskStatus[None]) -> None:
        await self._serve(until_idle=False, task_status=task_status)

    def _pool_kwargs(self) -> dict[str, Any]:
        return {
            "reset": _keep_session,
            "statement_cache_size": 100 if self.config.statement_cache else 0,
            "command_timeout": self.config.command_timeout,
            "server_settings": {"application_name": f"aioq worker {self.id}"[:63]},
        }

    async def _connect_listener(self) -> asyncpg.Connection:
        return await asyncpg.connect(
            self.config.listen_dsn or self.dsn,
            server_settings={"application_name": f"aioq listener {self.id}"[:63]},
            timeout=10,
            command_timeout=self.config.command_timeout,
        )

    async def _serve(
        self, *, until_idle: bool, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """One run: a pool, the schema checked, a Run built and served, the pool closed."""
        if self._running:
            raise ConfigError("worker", "this worker is already running")
        self._running = True
        if self.stopped.is_set():  # a run ended: start afresh (a stop() before a run holds)
            self.stopping, self.stopped = anyio.Event(), anyio.Event()
        served = False
        try:
            pool = self.pool or await asyncpg.create_pool(
                self.dsn, min_size=1, max_size=POOL_SIZE, **self._pool_kwargs()
            )
            try:
                await check_installed(pool, self.schema)  # one clear error, not a failing loop
                # Before anything else of the run: a worker whose id a live one holds starts
                # nothing, releases nothing (docs/architecture.md, "Worker ids").
                hold = self._id_hold(pool)
                if hold is not None:
                    await hold.take()
                try:
                    async with self._lifespan() as state:
                        self.current = run = Run(
                            config=self.config,
                            registry=self.registry,
                            pool=pool,
                            stopping=self.stopping,
                            connect_listener=self._connect_listener,
                            metrics=self.metrics,
                            middleware=self.middleware,
                            state=state,
                            hold=hold,
                        )
                        served = True
                        await run.serve(
                            until_idle=until_idle, on_started=_Started(self, task_status)
                        )
                finally:
                    if hold is not None:  # after the run's last release: the id comes free
                        await hold.close()
            finally:
                if pool is not self.pool:  # ours to close; an application's pool is not
                    with anyio.CancelScope(shield=True), anyio.move_on_after(10) as closing:
                        await pool.close()
                    if closing.cancelled_caught:  # a connection would not close in time
                        pool.terminate()
        finally:
            self.stopping.set()
            self.stopped.set()
            self._running = False
            if served:  # a worker that could not start says so in its error, not in a log line
                logger.info("worker %s stopped", self.id)

    def _id_hold(self, pool: asyncpg.Pool) -> IdHold | None:
        """The hold on a given worker id (None for a generated one, unique by construction)."""
        if isinstance(self.id, _GeneratedId):
            return None

        async def connect() -> tuple[Connection, Release]:
            dsn = self.config.listen_dsn or self.dsn
            if not dsn:
                # Only an application's pool (listen=False, no dsn): one of its connections,
                # for the run. It must be a session of its own (not PgBouncer's transaction
                # mode, where listen_dsn names a direct connection).
                borrowed = await pool.acquire()

                async def give_back() -> None:
                    await pool.release(borrowed)

                return borrowed, give_back
            conn = await asyncpg.connect(
                dsn,
                server_settings={
                    "application_name": f"aioq worker id {self.id}"[:63],
                    **KEEPALIVES,
                },
                timeout=10,
                command_timeout=self.config.command_timeout,
                statement_cache_size=0,
            )

            async def close() -> None:
                with anyio.move_on_after(10):
                    await conn.close()
                if not conn.is_closed():
                    conn.terminate()

            return conn, close

        return IdHold(
            schema=self.schema,
            worker_id=self.id,
            connect=connect,
            interval=self.config.heartbeat_interval,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self) -> AsyncIterator[object]:
        """Open the lifespan before the first claim; close it once the run (its last outcome
        written, its leftovers released) is over, however it ends."""
        if self.lifespan is None:
            yield None
            return
        try:
            manager = self.lifespan(self)
            state = await manager.__aenter__()
        except Exception as exc:
            raise StartupError(
                f"worker {self.id}: its lifespan failed to open: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            yield state
        finally:
            # Shielded: a hard cancel of the worker still closes what the lifespan opened.
            with anyio.CancelScope(shield=True), anyio.move_on_after(LIFESPAN_CLOSE) as closing:
                await manager.__aexit__(None, None, None)
            if closing.cancelled_caught:
                logger.warning(
                    "worker %s: its lifespan did not close within %gs", self.id, LIFESPAN_CLOSE
                )

    def _unserved_note(self) -> str:
        """Name the registered tasks whose queue the given queues leave out, for the start line.

        Not a warning: a worker given its queues (a dedicated per-queue worker) leaves the other
        tasks to other workers on purpose; the note says which, in the one line it logs at start.
        """
        left = self.registry.unserved(self.queues) if self.queues_given else []
        if not left:
            return ""
        named = ", ".join(f"{t.name} ({t.defaults.queue})" for t in left[:_UNSERVED_NAMED])
        more = f" and {len(left) - _UNSERVED_NAMED} more" if len(left) > _UNSERVED_NAMED else ""
        return f"; tasks of other queues, left to other workers: {named}{more}"


class _Started:
    """The run's start-up report: the worker logs that it serves, then tells its starter."""

    def __init__(self, worker: Worker, task_status: TaskStatus[None]) -> None:
        self.worker = worker
        self.task_status = task_status

    def started(self, value: None = None) -> None:
        worker = self.worker
        logger.info(
            "worker %s serving queues %s with %d consumers%s",
            worker.id,
            ",".join(worker.queues),
            worker.config.concurrency,
            worker._unserved_note(),
        )
        self.task_status.started()
