"""Prometheus metrics for workers (the ``aioq-pg[prometheus]`` extra).

prometheus_client is imported only when a :class:`Metrics` is built (or :func:`serve` or
:func:`start` is called), so ``import aioq`` works without the extra. Usage::

    metrics = aioq.metrics.start(9100)          # serves /metrics on :9100
    worker = aioq.Worker(dsn=..., metrics=metrics)

or mount ``metrics.asgi_app()`` in an ASGI application. Counters and histograms are updated
by the worker's producer and completer as jobs are claimed and their outcomes written; the
queue gauges are sampled from the database every ``stats_interval`` seconds by each worker that
has metrics, never per scrape.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from aioq.errors import ConfigError
from aioq.job import Claim, OutcomeKind
from aioq.sql.admin import QueueCounts

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ("DEFAULT_STATS_INTERVAL", "Metrics", "serve", "start")

logger = logging.getLogger(__name__)

DEFAULT_STATS_INTERVAL = 15.0
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_GAUGES = ("ready", "scheduled", "running", "dead", "expired", "oldest_ready_age", "waiting")


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(
            "metrics", "prometheus_client is not installed; install aioq-pg[prometheus]"
        ) from None
    return prometheus_client


_UNKNOWN_TASK_HELP = (
    "Claims of jobs whose task this worker does not know, handed on to a worker that knows it"
    " (attempt refunded)."
)


class Metrics:
    """The worker metrics, registered in ``registry`` (a new one with process metrics if None).

    One Metrics may be shared by several workers of a process; give each process its own.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        namespace: str = "aioq",
        stats_interval: float = DEFAULT_STATS_INTERVAL,
    ) -> None:
        # Over 80 lines on purpose: one declaration per metric, with its help text, so the
        # exported names read in one place.
        pc = _client()
        if not stats_interval > 0:
            raise ConfigError("stats_interval", f"must be > 0 seconds, got {stats_interval!r}")
        if registry is None:
            registry = pc.CollectorRegistry()
            pc.ProcessCollector(registry=registry)
            pc.PlatformCollector(registry=registry)
            pc.GCCollector(registry=registry)
        self.registry: CollectorRegistry = registry
        self.stats_interval = stats_interval
        ns, reg = namespace, registry
        qt = ("queue", "task")

        def counter(name: str, doc: str) -> Counter:
            return pc.Counter(name, doc, qt, namespace=ns, registry=reg)  # type: ignore[no-any-return]

        self.claimed = counter("jobs_claimed", "Jobs claimed by this process.")
        self.succeeded = counter("jobs_succeeded", "Jobs that completed successfully.")
        self.retried = counter("jobs_retried", "Failed attempts rescheduled for a retry.")
        self.dead = counter("jobs_dead", "Jobs that failed for good (no attempts left, or Fail).")
        self.snoozed = counter("jobs_snoozed", "Attempts that asked to run later (aioq.Retry).")
        self.released = counter("jobs_released", "Claims given back unfinished on shutdown.")
        self.cancelled = counter("jobs_cancelled", "Running jobs cancelled on request.")
        self.unknown_task = counter("jobs_unknown_task", _UNKNOWN_TASK_HELP)
        self.lease_lost = counter(
            "jobs_lease_lost", "Claims whose lease was lost to the reaper before their outcome."
        )
        self.schedule_failures: Counter = pc.Counter(
            "schedule_failures",
            "Passes of a schedule that raised; the other schedules went on.",
            ("schedule",),
            namespace=ns,
            registry=reg,
        )
        self.duration: Histogram = pc.Histogram(
            "job_duration_seconds",
            "Run time of one attempt, by outcome.",
            ("queue", "task", "outcome"),
            namespace=ns,
            registry=reg,
            buckets=DURATION_BUCKETS,
        )
        self.queue_wait: Histogram = pc.Histogram(
            "job_queue_wait_seconds",
            "Time from a job's run_at to its claim.",
            ("queue",),
            namespace=ns,
            registry=reg,
            buckets=WAIT_BUCKETS,
        )
        self.claim_seconds: Histogram = pc.Histogram(
            "claim_seconds",
            "Round trip of one claim statement.",
            namespace=ns,
            registry=reg,
            buckets=CLAIM_BUCKETS,
        )
        docs = {
            "ready": "Pending jobs whose run_at has come.",
            "scheduled": "Pending jobs due in the future.",
            "running": "Claimed jobs.",
            "dead": "Dead jobs kept in the table.",
            "expired": "Running jobs whose lease expired and that are not rescued yet.",
            "oldest_ready_age": "Seconds the oldest ready job has waited past its run_at.",
            "waiting": "Workflow steps waiting for their dependencies (not claimable).",
        }
        self.queue_gauges: dict[str, Gauge] = {
            name: pc.Gauge(
                f"queue_{name}_seconds" if name == "oldest_ready_age" else f"queue_{name}",
                docs[name],
                ("queue",),
                namespace=ns,
                registry=reg,
            )
            for name in _GAUGES
        }
        # Each outcome's counter is the attribute named as its value (self.succeeded, ...).
        self._outcome_counters: dict[OutcomeKind, Counter] = {
            kind: getattr(self, kind.value) for kind in OutcomeKind
        }
        # The labelled series of each (queue, task), looked up once: per job, ``labels()``
        # cost four times the update itself (a str() per label value and a lock).
        self._claim_series: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self._outcome_series: dict[tuple[str, str, OutcomeKind], tuple[Counter, Histogram]] = {}
        self._known_queues: set[str] = set()
        self._servers: list[tuple[Any, threading.Thread]] = []
        self.ports: list[int] = []  # where serve() listens

    def observe_claim(self, claims: Sequence[Claim], seconds: float) -> None:
        """Record one claim statement and the jobs it returned."""
        self.claim_seconds.observe(seconds)
        known = self._claim_series
        for claim in claims:
            series = known.get((claim.queue, claim.task))
            if series is None:
                series = known[claim.queue, claim.task] = (
                    self.claimed.labels(claim.queue, claim.task),
                    self.queue_wait.labels(claim.queue),
                )
            claimed, queue_wait = series
            claimed.inc()
            queue_wait.observe(claim.waited)

    def observe_outcome(self, claim: Claim, kind: OutcomeKind, duration: float) -> None:
        """Record an outcome written under our claim."""
        series = self._outcome_series.get((claim.queue, claim.task, kind))
        if series is None:
            series = self._outcome_series[claim.queue, claim.task, kind] = (
                self._outcome_counters[kind].labels(claim.queue, claim.task),
                self.duration.labels(claim.queue, claim.task, kind.value),
            )
        counter, duration_seconds = series
        counter.inc()
        duration_seconds.observe(duration)

    def observe_lease_lost(self, claim: Claim) -> None:
        """Record a claim this worker lost before it could write the outcome."""
        self.lease_lost.labels(claim.queue, claim.task).inc()

    def observe_schedule_failure(self, schedule: str) -> None:
        """Record a pass of a schedule that raised."""
        self.schedule_failures.labels(schedule).inc()

    def set_queue_stats(self, rows: Sequence[QueueCounts]) -> None:
        """Set the queue gauges from rows of the stats query; queues gone from it read 0."""
        seen: set[str] = set()
        for row in rows:
            seen.add(row.queue)
            for name in _GAUGES:
                self.queue_gauges[name].labels(row.queue).set(getattr(row, name))
        for queue in self._known_queues - seen:
            for gauge in self.queue_gauges.values():
                gauge.labels(queue).set(0)
        self._known_queues |= seen

    def asgi_app(self) -> Callable[..., Awaitable[None]]:
        """Return an ASGI app serving this registry (mount it at ``/metrics``)."""
        return _client().make_asgi_app(self.registry)  # type: ignore[no-any-return]

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve this registry over HTTP on ``addr:port`` (0: any free port); return the port."""
        server, thread = _client().start_http_server(port, addr=addr, registry=self.registry)
        self._servers.append((server, thread))
        self.ports.append(int(server.server_port))
        return self.ports[-1]

    def close(self) -> None:
        """Stop the HTTP servers :meth:`serve` started."""
        while self._servers:
            server, thread = self._servers.pop()
            server.shutdown()
            server.server_close()
            thread.join()
        self.ports.clear()


def serve(port: int, registry: CollectorRegistry | None = None, addr: str = "0.0.0.0") -> int:
    """Serve ``registry`` (prometheus_client's default if None) on ``addr:port``; return the port."""
    pc = _client()
    server, _ = pc.start_http_server(
        port, addr=addr, registry=pc.REGISTRY if registry is None else registry
    )
    return int(server.server_port)


def start(
    port: int,
    addr: str = "0.0.0.0",
    *,
    registry: CollectorRegistry | None = None,
    stats_interval: float = DEFAULT_STATS_INTERVAL,
) -> Metrics:
    """Build a :class:`Metrics` and serve it at ``http://addr:port/metrics``; for the CLI."""
    metrics = Metrics(registry, stats_interval=stats_interval)
    metrics.serve(port, addr)
    return metrics
