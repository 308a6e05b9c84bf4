"""The worker's monitors: the loop-lag monitor (when the event loop was blocked, and by which
jobs' tasks) and the queue sampler (the metrics' queue gauges)."""

from __future__ import annotations

import logging
import time

from aioq.db import Executor
from aioq.metrics import Metrics
from aioq.sql.admin import QUEUE_STATS
from aioq.worker.claims import Claims
from aioq.worker.service import Service

__all__ = ("LoopLag", "QueueSampler")

logger = logging.getLogger(__name__)

DEFAULT_LAG_TICK = 0.25


class LoopLag(Service[float]):
    """Measures how late each of its own wake-ups is; warns past ``threshold`` seconds.

    A task that blocks the event loop (``time.sleep`` in an ``async def``) stops every other
    coroutine of the worker, the heartbeat included: its leases may lapse and other workers
    rescue the jobs. The warning names the jobs running when it happened, since one of them
    is the culprit.
    """

    name = "loop lag"

    def __init__(self, *, claims: Claims, threshold: float, tick: float = DEFAULT_LAG_TICK) -> None:
        super().__init__()
        self.claims = claims
        self.threshold = threshold
        self.tick = tick
        self.expected: float | None = None  # when the current wait should end (monotonic)
        self.worst = 0.0

    def interval(self) -> float:
        """Seconds between measurements."""
        return self.tick

    async def wait(self, seconds: float) -> None:
        """Sleep, noting when the sleep should end."""
        self.expected = time.monotonic() + seconds
        await super().wait(seconds)

    async def run_once(self) -> float:
        """Return how late the last wake-up was (seconds); warn past the threshold."""
        if self.expected is None:
            return 0.0
        lag = max(0.0, time.monotonic() - self.expected)
        self.expected = None
        self.worst = max(self.worst, lag)
        if lag > self.threshold:
            running = sorted({f"{r.claim.task} (job {r.claim.id})" for r in self.claims.held()})
            logger.warning(
                "event loop blocked for %.2fs (a task doing blocking work in an async def?);"
                " running: %s",
                lag,
                ", ".join(running) or "no job",
                extra={"lag_s": round(lag, 3), "running": running},
            )
        return lag


class QueueSampler(Service[int]):
    """Samples the per-queue stats into the gauges, every ``metrics.stats_interval`` seconds."""

    name = "queue stats"

    def __init__(self, *, schema: str, db: Executor, metrics: Metrics) -> None:
        super().__init__()
        self.schema = schema
        self.db = db
        self.metrics = metrics

    async def run_once(self) -> int:
        """Sample once; return how many queues were seen."""
        rows = await QUEUE_STATS.rows(self.db, self.schema)
        self.metrics.set_queue_stats(rows)
        return len(rows)

    def interval(self) -> float:
        """Seconds between samples."""
        return self.metrics.stats_interval
