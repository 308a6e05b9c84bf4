"""What every background loop shares: a backoff for failing steps and a jittered tick."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable

import anyio

__all__ = ("StepBackoff", "jittered", "repeat")


class StepBackoff:
    """Capped exponential delays for a loop whose step keeps failing."""

    def __init__(self, first: float = 0.05, cap: float = 5.0) -> None:
        self.first, self.cap, self.failures = first, cap, 0

    def next(self) -> float:
        """Count a failure and return how long to wait before the next try."""
        self.failures += 1
        return jittered(min(self.cap, self.first * 2 ** (self.failures - 1)))

    def reset(self) -> None:
        """Forget past failures after a step succeeded."""
        self.failures = 0


def jittered(seconds: float, spread: float = 0.1) -> float:
    """Return ``seconds`` scaled by a random factor in [1 - spread, 1 + spread]."""
    return seconds * random.uniform(1 - spread, 1 + spread)


async def repeat(
    name: str,
    step: Callable[[], Awaitable[bool]],
    interval: Callable[[], float],
    logger: logging.Logger,
) -> None:
    """Run ``step`` forever, ``interval()`` apart (jittered); at once again if it returns True.

    A failing step is logged and retried with backoff; it never ends the loop.
    """
    backoff = StepBackoff()
    while True:
        try:
            again = await step()
        except Exception:
            delay = backoff.next()
            logger.exception("%s failed; retrying in %.2fs", name, delay)
            await anyio.sleep(delay)
            continue
        backoff.reset()
        if not again:
            await anyio.sleep(jittered(interval()))
