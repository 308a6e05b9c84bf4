"""The loop-lag monitor: says when the event loop was blocked, and by which jobs' tasks."""

from __future__ import annotations

import logging
import time

from aioq.service import Service
from aioq.worker.claims import Claims

__all__ = ("LoopLag",)

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
