"""The soak's tasks, run by ``aioq worker soak_tasks`` (benchmarks/soak.py starts it).

Every job carries ``t``, the enqueuer's clock (time.time()) just before its insert: the task
records the pickup latency (insert to start). An observer records each claim statement's round
trip. A thread of the worker's process writes, every ``AIOQ_SOAK_INTERVAL`` seconds, one JSON
line to ``AIOQ_SOAK_STATS``: jobs started so far and the interval's claim and pickup
percentiles; and every 20 ms the count of jobs started (the enqueued ones' first attempts and
the periodic ticks) to ``AIOQ_SOAK_STATS.count``. The thread runs only when that variable is set (the worker under the harness).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence

import aioq
import orjson
from aioq import hooks
from aioq.backoff import Backoff
from aioq.job import Claim

registry = aioq.Registry()

# Retries come back after 1 to 2 s (the default backoff starts at 1 s and doubles).
FAST_RETRY = Backoff(base=1.0, factor=2.0, max=2.0, jitter=0.25)


class Window:
    """Samples of the current interval; ``swap`` hands them over and starts a new one."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def add(self, value: float) -> None:
        self.values.append(value)

    def swap(self) -> list[float]:
        values, self.values = self.values, []
        return values


claim_ms = Window()
pickup_ms = Window()
started = 0


def _picked(t: float) -> None:
    global started
    started += 1
    pickup_ms.add((time.time() - t) * 1000)


@registry.task(name="noop")
async def noop(t: float) -> None:
    """Does nothing: the job's cost is aioq's."""
    _picked(t)


@registry.task(name="flaky", retry=FAST_RETRY, max_attempts=3)
async def flaky(t: float, fails: int) -> None:
    """Fails its first ``fails`` attempts (a RuntimeError), then succeeds; more than two
    failures make it dead (max_attempts=3)."""
    ctx = aioq.current_job()
    if ctx.attempt == 1:
        _picked(t)
    if ctx.attempt <= fails:
        raise RuntimeError(f"failure {ctx.attempt} of {fails}")


@registry.task(name="keep", result_ttl=60.0)
async def keep(t: float) -> dict[str, float | int]:
    """Returns a small result, kept a minute (the pruner deletes it after)."""
    _picked(t)
    return {"t": t, "ms": int(t * 1000) % 1000}


@registry.task(name="step")
async def step(t: float, i: int) -> int:
    """A workflow's step."""
    _picked(t)
    return i


@aioq.periodic(every=1.0)
@registry.task(name="tick")
async def tick() -> None:
    """The periodic job, every second (counted with the others: its row is a job too)."""
    global started
    started += 1


class ClaimTimes(hooks.Observer):
    """Each claim statement's round trip, in ms."""

    def claimed(self, worker_id: str, claims: Sequence[Claim], start_ns: int, end_ns: int) -> None:
        claim_ms.add((end_ns - start_ns) / 1e6)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


COUNT_EVERY = 0.02  # the count of started jobs, for the harness's backlog (fresh within 20 ms)


def _report(path: str, every: float) -> None:
    count = os.open(path + ".count", os.O_WRONLY | os.O_CREAT, 0o644)
    with open(path, "ab", buffering=0) as out:
        start = time.monotonic()
        next_line = every
        for k in range(1, 1 << 62):
            time.sleep(max(0.0, start + k * COUNT_EVERY - time.monotonic()))
            os.pwrite(count, b"%20d" % started, 0)
            if time.monotonic() - start < next_line:
                continue
            next_line += every
            claims, pickups = claim_ms.swap(), pickup_ms.swap()
            line = {
                "at": time.time(),
                "started": started,
                "claims": len(claims),
                "claim_p50_ms": pct(claims, 0.5),
                "claim_p99_ms": pct(claims, 0.99),
                "claim_max_ms": max(claims, default=None),
                "pickup_p50_ms": pct(pickups, 0.5),
                "pickup_p99_ms": pct(pickups, 0.99),
            }
            out.write(orjson.dumps(line) + b"\n")


if os.environ.get("AIOQ_SOAK_STATS"):
    hooks.install(ClaimTimes())
    interval = float(os.environ.get("AIOQ_SOAK_INTERVAL", "1"))
    if not (math.isfinite(interval) and interval > 0):
        raise ValueError(f"AIOQ_SOAK_INTERVAL: {interval!r}")
    threading.Thread(
        target=_report, args=(os.environ["AIOQ_SOAK_STATS"], interval), daemon=True
    ).start()
