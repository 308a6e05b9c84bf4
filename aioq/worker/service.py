"""What every background loop of a worker shares: one retry loop, one backoff, test signals.

A service (River's shape) has ``run_once()``, one pass that tests call directly with no clock,
and ``run()``, which repeats passes: ``interval()`` apart (jittered), at once again while
:meth:`Service.busy` says so, and after a failing pass again with backoff, never ending the
loop. ``passed`` fires after each pass that succeeded, so tests wait on it instead of polling.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Generic, TypeVar

import anyio
from anyio.abc import TaskStatus

from aioq.backoff import Backoff, Failures, jittered

__all__ = ("STEP_BACKOFF", "Service", "Signal")

R = TypeVar("R")

logger = logging.getLogger(__name__)

STEP_BACKOFF = Backoff(base=0.05, max=5.0, jitter=0.1)
"""The delays after a failing pass: 50 ms doubling up to 5 s."""


class Signal:
    """Fires after each pass of a service; ``await signal.wait()`` returns at the next one."""

    def __init__(self) -> None:
        self.count = 0
        self._event = anyio.Event()

    def fire(self) -> None:
        """Wake every waiter; count the pass."""
        self.count += 1
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> None:
        """Return after the next pass."""
        await self._event.wait()


class Service(Generic[R]):
    """A worker's background loop: subclasses give ``run_once`` and, if needed, the hooks.

    ``R`` is what one pass returns (what :meth:`busy` judges).
    """

    name: ClassVar[str] = "service"
    backoff: ClassVar[Backoff] = STEP_BACKOFF

    def __init__(self) -> None:
        self.passed = Signal()
        self.failures = Failures(self.backoff)

    async def run_once(self) -> R:
        """Do one pass of work."""
        raise NotImplementedError

    def interval(self) -> float:
        """Seconds between passes when the last one left nothing to do."""
        raise NotImplementedError

    def busy(self, result: R) -> bool:
        """Whether to start the next pass at once (the last one filled a batch)."""
        return False

    def stopped(self) -> bool:
        """Whether the loop is to end (most run until cancelled)."""
        return False

    async def wait(self, seconds: float) -> None:
        """Wait before the next pass; ``seconds`` is a jittered interval or a failure's backoff."""
        await anyio.sleep(seconds)

    def log_failure(self, exc: Exception, delay: float) -> None:
        """Report a failed pass."""
        logger.error("%s failed; retrying in %.2fs", self.name, delay, exc_info=exc)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Repeat passes until stopped or cancelled; a failing pass never ends the loop."""
        task_status.started()
        while not self.stopped():
            try:
                result = await self.run_once()
            except Exception as exc:
                delay = self.failures.next()
                self.log_failure(exc, delay)
                await self.wait(delay)
                continue
            self.failures.reset()
            self.passed.fire()
            if not self.busy(result) and not self.stopped():
                await self.wait(jittered(self.interval()))
