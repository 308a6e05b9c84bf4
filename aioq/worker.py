"""The worker: one supervisor, one asyncpg pool, one LISTEN connection, one anyio task group."""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskGroup, TaskStatus

from aioq.completer import SHUTDOWN, Completer, Running
from aioq.consumer import Consumer
from aioq.errors import ConfigError
from aioq.lease import Heartbeat, Reaper
from aioq.maintenance import Pruner, Vacuumer
from aioq.metrics import Metrics, QueueSampler
from aioq.notifier import Listener
from aioq.producer import Doorbell, Handoff, Producer, Slots
from aioq.queries import quote_schema
from aioq.store import Store
from aioq.task import Registry, check_text, default_registry

__all__ = ("Worker", "WorkerConfig")

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 10
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_HEARTBEAT_INTERVAL = 5.0
DEFAULT_REAPER_INTERVAL = 5.0
DEFAULT_REAPER_BATCH = 1000
DEFAULT_SHUTDOWN_GRACE = 30.0
DEFAULT_CLAIM_BATCH = 100
DEFAULT_COMPLETION_BATCH = 1000
DEFAULT_ARCHIVE_RETENTION = 7 * 24 * 3600.0
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


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    """How a worker runs; every duration is in seconds."""

    queues: tuple[str, ...] = ("default",)
    concurrency: int = DEFAULT_CONCURRENCY
    schema: str = "aioq"
    poll_interval: float = DEFAULT_POLL_INTERVAL
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    reaper_interval: float = DEFAULT_REAPER_INTERVAL
    reaper_batch: int = DEFAULT_REAPER_BATCH
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    claim_batch: int = DEFAULT_CLAIM_BATCH
    completion_batch: int = DEFAULT_COMPLETION_BATCH
    keep_completed: bool = False
    # Retention (None keeps rows forever): archived jobs by finished_at, dead jobs by run_at.
    archive_retention: float | None = DEFAULT_ARCHIVE_RETENTION
    dead_retention: float | None = None
    prune_interval: float = DEFAULT_PRUNE_INTERVAL
    prune_batch: int = DEFAULT_PRUNE_BATCH
    # None leaves the jobs table to autovacuum alone.
    vacuum_threshold: int | None = DEFAULT_VACUUM_THRESHOLD
    vacuum_interval: float = DEFAULT_VACUUM_INTERVAL
    listen: bool = True
    # PgBouncer in transaction mode: no prepared-statement cache on the pool, and LISTEN
    # through listen_dsn (a direct connection), since a pooler cannot hold a LISTEN.
    statement_cache: bool = True
    listen_dsn: str | None = None
    command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT
    worker_id: str = field(default_factory=lambda: _default_worker_id())

    def __post_init__(self) -> None:
        quote_schema(self.schema)
        if not self.queues or any(not q for q in self.queues):
            raise ConfigError("queues", f"must be non-empty queue names, got {self.queues!r}")
        for queue in self.queues:
            check_text("queues", queue)
        for name in (
            "concurrency",
            "reaper_batch",
            "claim_batch",
            "completion_batch",
            "prune_batch",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        if self.vacuum_threshold is not None and (
            not isinstance(self.vacuum_threshold, int) or self.vacuum_threshold < 1
        ):
            raise ConfigError(
                "vacuum_threshold",
                f"must be None or an integer >= 1, got {self.vacuum_threshold!r}",
            )
        for name in (
            "poll_interval",
            "heartbeat_interval",
            "reaper_interval",
            "prune_interval",
            "vacuum_interval",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0 seconds, got {getattr(self, name)!r}")
        if self.command_timeout is not None and not self.command_timeout > 0:
            raise ConfigError(
                "command_timeout", f"must be None or > 0 seconds, got {self.command_timeout!r}"
            )
        for name in ("archive_retention", "dead_retention"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ConfigError(name, f"must be None or >= 0 seconds, got {value!r}")
        if self.shutdown_grace < 0:
            raise ConfigError("shutdown_grace", f"must be >= 0 seconds, got {self.shutdown_grace}")
        if not self.worker_id:
            raise ConfigError("worker_id", "must not be empty")


async def _keep_session(connection: asyncpg.Connection) -> None:
    """Skip asyncpg's reset on release: a second round trip per statement.

    The pool runs only aioq's statements, which leave no session state behind (no LISTEN,
    advisory locks, cursors or SET); asyncpg still rolls back a transaction left open.
    """


def _default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Worker:
    """Runs the jobs of a registry's tasks from the given queues.

    ``await worker.run()`` serves until cancelled or :meth:`stop`; ``async with worker:``
    serves in the background and stops gracefully on exit; ``await worker.run_until_idle()``
    returns once no job is ready or running. Without ``queues`` it serves ``default`` and every
    queue its registry's tasks name. It opens a pool of its own from ``dsn``, or borrows
    ``pool`` (an application's, never closed here; ``dsn`` then serves only LISTEN).
    """

    def __init__(
        self,
        *,
        dsn: str | None = None,
        pool: asyncpg.Pool | None = None,
        registry: Registry | None = None,
        queues: Sequence[str] | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        schema: str | None = None,
        metrics: Metrics | None = None,
        **options: Any,
    ) -> None:
        self.registry = registry if registry is not None else default_registry
        if isinstance(queues, str):
            queues = (queues,)
        # No queues given: serve every queue the registry's tasks name (issue 11, point 1).
        self.queues_given = queues is not None
        self.config = WorkerConfig(
            queues=tuple(queues) if queues is not None else self.registry.queues(),
            concurrency=concurrency,
            schema=self.registry.schema if schema is None else schema,
            **options,
        )
        if dsn is None and (pool is None or (self.config.listen and not self.config.listen_dsn)):
            raise ConfigError(
                "dsn",
                "a worker needs dsn= (with pool=, for its one LISTEN connection; or give"
                " listen_dsn=, or listen=False to rely on polling)",
            )
        self.dsn = dsn or ""
        # An application's pool (pool=) is used as it is and never closed by the worker.
        self.pool = pool
        self.id = self.config.worker_id
        self.store = Store.for_schema(self.config.schema)
        self.in_flight: dict[int, Running] = {}
        self.doorbell = Doorbell()
        self.stopping = anyio.Event()
        self.stopped = anyio.Event()
        self.listener: Listener | None = None
        self._producer: Producer | None = None
        self._tg: TaskGroup | None = None
        self.metrics = metrics

    def __repr__(self) -> str:
        return f"<aioq.Worker {self.id} queues={list(self.config.queues)}>"

    def stop(self) -> None:
        """Stop claiming; running jobs get ``shutdown_grace`` seconds, then are released."""
        if not self.stopping.is_set():
            logger.info("worker %s stopping", self.id)
        self.stopping.set()
        if self._producer is not None:
            self._producer.stop()

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
            await self._tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
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

    def _listening(self) -> bool:
        return self.listener is not None and self.listener.connected.is_set()

    async def _arm_doorbell(self) -> bool:
        return self.listener is not None and await self.listener.arm()

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
        cfg = self.config
        if self.stopped.is_set():
            raise ConfigError("worker", "a worker runs once; create a new Worker to run again")
        if self.pool is not None:
            pool = self.pool
        else:
            pool = await asyncpg.create_pool(
                self.dsn, min_size=1, max_size=POOL_SIZE, **self._pool_kwargs()
            )
        completer = Completer(
            store=self.store,
            db=pool,
            worker_id=self.id,
            in_flight=self.in_flight,
            keep_completed=cfg.keep_completed,
            batch_size=cfg.completion_batch,
            max_pending=2 * cfg.concurrency + cfg.completion_batch,
        )
        slots = Slots(cfg.concurrency)
        producer = Producer(
            store=self.store,
            db=pool,
            queues=cfg.queues,
            worker_id=self.id,
            slots=slots,
            doorbell=self.doorbell,
            in_flight=self.in_flight,
            completer=completer,
            poll_interval=cfg.poll_interval,
            batch_size=cfg.claim_batch,
            stopping=self.stopping,
            listening=self._listening,
            arm=self._arm_doorbell,
        )
        self._producer = producer
        completer.metrics = producer.metrics = self.metrics
        if self.stopping.is_set():
            producer.stop()
        consumer = Consumer(
            registry=self.registry,
            worker_id=self.id,
            in_flight=self.in_flight,
            limiter=anyio.CapacityLimiter(cfg.concurrency),
            stopping=self.stopping,
            completer=completer,
        )

        def job_done() -> None:
            slots.give()
            if until_idle and slots.busy == 0:
                self.doorbell.ring()  # the producer checks whether the queue is idle

        try:
            async with anyio.create_task_group() as services:
                await services.start(completer.run)
                if cfg.listen:
                    self.listener = Listener(
                        connect=self._connect_listener,
                        channel=self.store.channel,
                        queues=cfg.queues,
                        ring=self.doorbell.ring,
                        store=self.store,
                    )
                    await services.start(self.listener.run)
                heartbeat = Heartbeat(
                    store=self.store,
                    db=pool,
                    worker_id=self.id,
                    in_flight=self.in_flight,
                    interval=cfg.heartbeat_interval,
                )
                services.start_soon(heartbeat.run)
                reaper = Reaper(
                    store=self.store,
                    db=pool,
                    interval=cfg.reaper_interval,
                    batch_size=cfg.reaper_batch,
                )
                services.start_soon(reaper.run)
                if cfg.archive_retention is not None or cfg.dead_retention is not None:
                    pruner = Pruner(
                        store=self.store,
                        db=pool,
                        archive_retention=cfg.archive_retention,
                        dead_retention=cfg.dead_retention,
                        interval=cfg.prune_interval,
                        batch_size=cfg.prune_batch,
                    )
                    services.start_soon(pruner.run)
                if cfg.vacuum_threshold is not None:
                    vacuumer = Vacuumer(
                        store=self.store,
                        db=pool,
                        threshold=cfg.vacuum_threshold,
                        interval=cfg.vacuum_interval,
                    )
                    services.start_soon(vacuumer.run)
                if self.metrics is not None:
                    sampler = QueueSampler(store=self.store, db=pool, metrics=self.metrics)
                    services.start_soon(sampler.run)
                self._warn_unserved()
                logger.info(
                    "worker %s serving queues %s with %d consumers",
                    self.id,
                    ",".join(cfg.queues),
                    cfg.concurrency,
                )
                task_status.started()
                async with anyio.create_task_group() as jobs:
                    jobs.start_soon(self._enforce_grace)
                    handoff = Handoff()
                    async with anyio.create_task_group() as consumers:
                        consumers.start_soon(
                            functools.partial(producer.run, handoff, until_idle=until_idle)
                        )
                        for _ in range(cfg.concurrency):
                            consumers.start_soon(consumer.run, handoff, job_done)
                    jobs.cancel_scope.cancel()
                self.stopping.set()
                with anyio.move_on_after(max(cfg.shutdown_grace, 5.0)):
                    await completer.wait_idle()
                services.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._release_leftovers(completer, pool)
                if pool is not self.pool:  # ours to close; an application's pool is not
                    with anyio.move_on_after(10) as closing:
                        await pool.close()
                    if closing.cancelled_caught:  # a connection would not close in time
                        pool.terminate()
                self.stopping.set()
                self.stopped.set()
                logger.info("worker %s stopped", self.id)

    def _warn_unserved(self) -> None:
        """Warn once per registered task whose queue the explicitly given queues leave out."""
        if not self.queues_given:
            return
        for task in self.registry.unserved(self.config.queues):
            logger.warning(
                "worker %s does not serve queue %r of task %r: its jobs wait for another"
                " worker (serving: %s)",
                self.id,
                task.defaults.queue,
                task.name,
                ",".join(self.config.queues),
            )

    async def _enforce_grace(self) -> None:
        """After stop(), give running jobs shutdown_grace seconds, then cancel them."""
        await self.stopping.wait()
        await anyio.sleep(self.config.shutdown_grace)
        cancelled = [r for r in self.in_flight.values() if r.scope is not None]
        if cancelled:
            logger.warning(
                "worker %s: %d jobs still running after %.1fs grace; releasing them",
                self.id,
                len(cancelled),
                self.config.shutdown_grace,
            )
        for running in cancelled:
            running.cancel(SHUTDOWN)

    async def _release_leftovers(self, completer: Completer, pool: asyncpg.Pool) -> None:
        """Write what is queued, then give back claims that have no outcome (hard cancel)."""
        with anyio.move_on_after(10):
            await completer.flush()
            left = [r.claim for r in self.in_flight.values() if not r.finished]
            if not left:
                return
            try:
                released = await self.store.reschedule(
                    pool,
                    [c.id for c in left],
                    [c.attempt for c in left],
                    self.id,
                    delays=[0.0] * len(left),
                    errors=[None] * len(left),
                    refunds=[True] * len(left),
                )
            except Exception:
                logger.exception(
                    "could not release %d claims; they return when their leases expire", len(left)
                )
                return
            for claim in left:
                self.in_flight.pop(claim.id, None)
            logger.warning("worker %s released %d unfinished claims", self.id, len(released))
