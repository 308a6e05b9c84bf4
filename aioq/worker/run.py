"""One run of a worker: every service built once, from the configuration, and the one shutdown.

docs/architecture.md, "Inside a worker". A :class:`Run` is made per run of a Worker (a worker
can run again once a run ended): its constructor builds every component with all it needs, so
nothing is wired afterwards, and it owns the run's state (the claims, the slots, the doorbell)
until the run ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
from anyio.abc import TaskStatus

from aioq.doorbell import Doorbell
from aioq.job import OutcomeKind
from aioq.metrics import Metrics
from aioq.registry import Middleware, Registry
from aioq.sql import DEFAULT_SCHEMA, control_channel
from aioq.worker.claimer import Claimer
from aioq.worker.claims import CancelReason, Claims
from aioq.worker.completer import Completer, Outcome
from aioq.worker.consumer import Consumer
from aioq.worker.control import CancelWatch
from aioq.worker.health import Probe
from aioq.worker.history import StatsRecorder, StatsWriter
from aioq.worker.identity import IdHold
from aioq.worker.lease import Heartbeat, Reaper
from aioq.worker.maintenance import Pruner, Vacuumer
from aioq.worker.monitor import LoopLag, QueueSampler
from aioq.worker.notifier import Listener
from aioq.worker.producer import ClaimAhead, Producer, Slots
from aioq.worker.scheduler import Scheduler
from aioq.worker.service import Service

if TYPE_CHECKING:
    from aioq.worker import WorkerConfig

__all__ = ("MIN_FINAL_WRITE", "Run")

logger = logging.getLogger(__name__)

# The completer gets at most this long after the jobs ended to write their outcomes (at least
# the grace): what is left is written, or released, by the shielded clean-up.
MIN_FINAL_WRITE = 5.0


class Run:
    """The services of one run, their shared state, and how the run ends."""

    def __init__(
        self,
        *,
        config: WorkerConfig,
        registry: Registry,
        pool: asyncpg.Pool,
        stopping: anyio.Event,
        connect_listener: Any,
        metrics: Metrics | None,
        middleware: Sequence[Middleware] = (),
        state: object = None,
        hold: IdHold | None = None,
    ) -> None:
        cfg = self.config = config
        schema, worker_id = cfg.schema, cfg.worker_id
        assert schema is not None  # the Worker filled it in
        assert cfg.queues is not None
        self.worker_id = worker_id
        self.queues = cfg.queues
        self.pool = pool
        self.stopping = stopping
        self.claims = Claims()
        self.doorbell = Doorbell()
        self.slots = Slots(cfg.concurrency)
        self.history = StatsRecorder() if cfg.stats_history else None
        self.claimer = Claimer(
            schema=schema,
            db=pool,
            queues=cfg.queues,
            worker_id=worker_id,
            ring=self.doorbell.ring,
            refresh=cfg.limits_refresh,
            unknown_task_grace=cfg.unknown_task_grace,
        )
        self.completer = Completer(
            schema=schema,
            db=pool,
            worker_id=worker_id,
            claims=self.claims,
            keep_completed=cfg.keep_completed,
            batch_size=cfg.completion_batch,
            max_pending=2 * cfg.concurrency + cfg.completion_batch,
            metrics=metrics,
            history=self.history,
            on_written=self.claimer.written,
        )
        # Cancel requests: by notification (the listener) and by polling (the guarantee).
        cancel_watch = CancelWatch(
            schema=schema,
            db=pool,
            worker_id=worker_id,
            claims=self.claims,
            interval=cfg.heartbeat_interval,
        )
        self.listener = (
            Listener(
                connect=connect_listener,
                schema=schema,
                queues=cfg.queues,
                ring=self.doorbell.ring,
                control={control_channel(schema): cancel_watch.on_notify},
                on_limits=self.claimer.changed,
            )
            if cfg.listen
            else None
        )
        fixed = None if cfg.prefetch == "auto" else cfg.prefetch
        self.producer = Producer(
            claimer=self.claimer,
            claims=self.claims,
            slots=self.slots,
            doorbell=self.doorbell,
            stopping=stopping,
            poll_interval=cfg.poll_interval,
            batch_size=cfg.claim_batch,
            ahead=ClaimAhead(fixed=fixed, limit=cfg.concurrency),
            completer=self.completer,
            listener=self.listener,
            metrics=metrics,
        )
        self.consumer = Consumer(
            registry=registry,
            worker_id=worker_id,
            claims=self.claims,
            completer=self.completer,
            stopping=stopping,
            threads=anyio.CapacityLimiter(cfg.concurrency),
            middleware=middleware,
            state=state,
            unknown=self.claimer,
        )
        # Worker.health() and the probes' server read these (docs/architecture.md, "Health").
        self.probe = Probe(schema=schema, db=pool)
        self.began = time.monotonic()
        self.serving = False  # the services are up and the consumers started
        # In start order (the hold on a given id first); the producer last: it starts with jobs.
        self.services: list[Service[Any]] = [*self._held(hold), self.completer, self.probe]
        self.services += [cancel_watch] if self.listener is None else [cancel_watch, self.listener]
        self.services += _upkeep(cfg, registry, pool, self.claims, self.history, metrics)
        self.services.append(self.producer)

    def _held(self, hold: IdHold | None) -> list[Service[Any]]:
        """The hold on a given worker id, taken before the run (docs/architecture.md, "Worker
        ids"): a live worker that took the id while its connection was down stops this run."""
        self.hold = hold
        if hold is None:
            return []
        hold.on_lost = self._id_lost
        return [hold]

    def _id_lost(self) -> None:
        """Another live worker holds our id now: its rows are not ours to release. Release
        only the claims we hold, fenced, and stop."""
        self.claimer.by_id = False
        self.stop()

    def stop(self) -> None:
        """Stop claiming; running jobs get the grace, then are cancelled and released."""
        if not self.stopping.is_set():
            logger.info("worker %s stopping", self.worker_id)
        self.producer.stop()

    async def serve(
        self, *, until_idle: bool, on_started: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Services up, jobs served until stopped, then the one shutdown path."""
        cfg = self.config
        try:
            if self.stopping.is_set():
                self.stop()
            async with anyio.create_task_group() as services:
                for service in self.services[:-1]:  # the producer starts with the jobs
                    await services.start(service.run)
                self.serving = True
                on_started.started()
                async with anyio.create_task_group() as jobs:
                    jobs.start_soon(self._enforce_grace)
                    if until_idle:
                        jobs.start_soon(self._stop_when_idle)
                    async with anyio.create_task_group() as consumers:
                        consumers.start_soon(self.producer.run)
                        for _ in range(cfg.concurrency):
                            consumers.start_soon(
                                self.consumer.run, self.producer.handoff, self.slots.give
                            )
                    jobs.cancel_scope.cancel()
                self.stop()  # the producer may have ended on its own (cancelled elsewhere)
                with anyio.move_on_after(max(cfg.shutdown_grace, MIN_FINAL_WRITE)):
                    await self.completer.wait_idle()
                services.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._release_leftovers()

    async def _stop_when_idle(self) -> None:
        """run_until_idle's one owner: stop once a claim finds nothing while nothing runs.

        At some instant nothing runs and every outcome is written; then a claim pass that
        began after that instant ends, and no job was claimed since: nothing was ready (an
        outcome that made a job ready again was written before the pass began).
        """
        producer, slots, completer = self.producer, self.slots, self.completer
        while True:
            await slots.wait_idle()
            await completer.wait_idle()
            if slots.busy or not completer.idle:
                continue  # a job came and went while we waited: look again
            since, taken = producer.started, slots.taken
            self.doorbell.ring()
            while producer.last_pass <= since:
                await producer.passed.wait()
            if slots.taken == taken:
                self.stop()
                return

    async def _enforce_grace(self) -> None:
        """After a stop, give running jobs shutdown_grace seconds, then cancel them.

        A plain ``def`` task's thread cannot be cancelled: its job stays claimed (the
        heartbeat goes on) and the worker waits for the thread to return, saying so.
        """
        grace = self.config.shutdown_grace
        await self.stopping.wait()
        await anyio.sleep(grace)
        cancelled = self.claims.cancel_all(CancelReason.SHUTDOWN)
        if cancelled:
            logger.warning(
                "worker %s: %d jobs still running after %.1fs grace; releasing them",
                self.worker_id,
                len(cancelled),
                grace,
            )
        while threads := self.claims.threads():
            logger.warning(
                "worker %s: waiting for %d task threads, which cannot be interrupted (%s);"
                " their jobs stay claimed until they return",
                self.worker_id,
                len(threads),
                ", ".join(sorted({f"{r.claim.task} (job {r.claim.id})" for r in threads})),
            )
            with anyio.move_on_after(max(grace, MIN_FINAL_WRITE)):
                await self.claims.wait_threads_done()

    async def _release_leftovers(self) -> None:
        """Write what is queued, then give back every row still held under our id.

        That includes the claims with no outcome (a hard cancel) and the rows of a claim
        whose reply never arrived (cancelled mid-statement): the database knows them by our
        worker id, we do not. A job whose thread still runs keeps its claim.
        """
        with anyio.move_on_after(10):
            await self.completer.flush()
            keep = [r.claim.id for r in self.claims.threads()]
            if not self.claimer.by_id:
                # Our id is another live worker's now: release what we hold, fenced, never
                # the rows under the id (they may be its).
                for claim in self.claims.leftovers():
                    if claim.id not in keep:
                        self.completer.put(Outcome(claim, OutcomeKind.RELEASED))
                await self.completer.flush()
                return
            try:
                released = await self.claimer.release(keep=keep)
            except Exception:
                logger.exception(
                    "could not release this worker's claims; they return when their leases expire"
                )
                return
            for claim in self.claims.leftovers():
                if claim.id not in keep:
                    self.claims.settle(claim)
            if released:
                logger.warning(
                    "worker %s released %d unfinished claims",
                    self.worker_id,
                    len(released),
                    extra={"released": len(released)},
                )


def _upkeep(
    cfg: WorkerConfig,
    registry: Registry,
    pool: asyncpg.Pool,
    claims: Claims,
    history: StatsRecorder | None,
    metrics: Metrics | None,
) -> list[Service[Any]]:
    """The services of a run that keep leases, tables and figures: those the config asks for."""
    schema, worker_id = cfg.schema or DEFAULT_SCHEMA, cfg.worker_id
    assert cfg.queues is not None
    services: list[Service[Any] | None] = [
        Heartbeat(
            schema=schema,
            db=pool,
            worker_id=worker_id,
            claims=claims,
            interval=cfg.heartbeat_interval,
        ),
        Reaper(
            schema=schema,
            db=pool,
            interval=cfg.reaper_interval,
            batch_size=cfg.reaper_batch,
            worker_id=worker_id,
        ),
        # Always: expired results are pruned whatever the retention.
        Pruner(
            schema=schema,
            db=pool,
            archive_retention=cfg.archive_retention,
            dead_retention=cfg.dead_retention,
            workflow_retention=cfg.workflow_retention,
            interval=cfg.prune_interval,
            batch_size=cfg.prune_batch,
        ),
        Vacuumer(
            schema=schema, db=pool, threshold=cfg.vacuum_threshold, interval=cfg.vacuum_interval
        )
        if cfg.vacuum_threshold is not None
        else None,
        Scheduler(
            schema=schema, db=pool, schedules=list(registry.schedules.values()), metrics=metrics
        )
        if cfg.periodic and registry.schedules
        else None,
        QueueSampler(schema=schema, db=pool, metrics=metrics) if metrics is not None else None,
        LoopLag(claims=claims, threshold=cfg.lag_threshold)
        if cfg.lag_threshold is not None
        else None,
        StatsWriter(
            schema=schema,
            db=pool,
            recorder=history,
            worker_id=worker_id,
            queues=cfg.queues,
            concurrency=cfg.concurrency,
            interval=cfg.stats_interval,
            retention=cfg.stats_retention,
        )
        if history is not None
        else None,
    ]
    return [s for s in services if s is not None]
