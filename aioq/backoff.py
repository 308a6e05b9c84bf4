"""The one backoff: exponential with jitter, capped; for job retries and for failing loops."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from aioq.errors import MAX_RETRY_DELAY, ConfigError

__all__ = ("Backoff", "Failures", "jittered")


@dataclass(frozen=True, kw_only=True, slots=True)
class Backoff:
    """Exponential backoff with jitter: ``base * factor**(attempt-1)``, capped at ``max``."""

    base: float = 1.0
    factor: float = 2.0
    max: float = 3600.0
    jitter: float = 0.25  # each delay is scaled by a random factor in [1 - jitter, 1 + jitter]

    def __post_init__(self) -> None:
        # Each delay becomes an interval in the completer's statement: NaN or an overflowing
        # value would fail the whole batch of outcomes it is written with.
        for name in ("base", "max"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_RETRY_DELAY):
                raise ConfigError(
                    name,
                    f"must be finite, between 0 and {MAX_RETRY_DELAY:.0f} seconds; got {value!r}",
                )
        if not (math.isfinite(self.factor) and self.factor >= 1):
            raise ConfigError("factor", f"must be >= 1, got {self.factor}")
        if self.max < self.base:
            raise ConfigError("max", f"must be >= base ({self.base}), got {self.max}")
        if not 0 <= self.jitter < 1:
            raise ConfigError("jitter", f"must be in [0, 1), got {self.jitter}")

    def delay(self, attempt: int) -> float:
        """Return the delay in seconds before the attempt after ``attempt`` (1-based)."""
        exponent = min(max(attempt - 1, 0), 64)
        try:
            raw = min(self.max, self.base * self.factor**exponent)
        except OverflowError:  # a large factor: 1e10 ** 32 is past any float, and past max
            raw = self.max
        return min(self.max, jittered(raw, self.jitter))


class Failures:
    """Consecutive failures of a loop's step, and how long to wait before the next try."""

    def __init__(self, policy: Backoff) -> None:
        self.policy = policy
        self.count = 0

    def next(self) -> float:
        """Count a failure and return how long to wait before the next try."""
        self.count += 1
        return self.policy.delay(self.count)

    def reset(self) -> None:
        """Forget past failures after a step succeeded."""
        self.count = 0


def jittered(seconds: float, spread: float = 0.1) -> float:
    """Return ``seconds`` scaled by a random factor in [1 - spread, 1 + spread]."""
    return seconds * random.uniform(1 - spread, 1 + spread) if spread else seconds
