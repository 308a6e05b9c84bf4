"""What the measurement scripts share: CPU time, percentiles, preloading, counting task starts."""

from __future__ import annotations

import asyncio
import math
import resource
import time
from typing import Any

import asyncpg
from aioq.job import Claim, OutcomeKind
from aioq.sql import results_channel
from aioq.sql.outcomes import WRITE_OUTCOMES

import systems


async def complete(conn: asyncpg.Connection, claim: Claim) -> None:
    """Write one claim's completion as a worker's completer would (aioq's outcome statement)."""
    await WRITE_OUTCOMES.rows(
        conn,
        "aioq",
        [claim.id],
        [claim.number],
        "bench",
        [OutcomeKind.COMPLETE.value],
        [0.0],
        [None],
        [None],
        [None],
        False,
        results_channel("aioq"),
    )


def rusage() -> float:
    """User+sys CPU seconds of this process."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank below), None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def preload(
    system: systems.System, n: int, batch: int = 1000, deadline: float = math.inf
) -> int:
    """Defer ``n`` no-op jobs through the system's bulk API; stop at ``deadline``: jobs deferred."""
    done = 0
    while done < n and time.perf_counter() < deadline:
        count = min(batch, n - done)
        await system.defer_many(done, count)
        done += count
    return done


async def aioq_defer(
    conn: asyncpg.Connection, n: int, *, start: int = 0, batch: int = 10_000, **options: Any
) -> None:
    """aioq's ``noop.defer_many`` of jobs ``start`` .. ``start + n`` on ``conn``, with options."""
    from systems.sys_aioq import noop

    task = noop.options(**options) if options else noop
    for lo in range(start, start + n, batch):
        await task.defer_many(conn, [{"i": i} for i in range(lo, min(lo + batch, start + n))])


class Runs:
    """Counts task starts: ``systems.hook = runs.count`` (or call it from a hook of one's own)."""

    def __init__(self) -> None:
        self.n = 0
        self._target = math.inf
        self._reached = asyncio.Event()

    def count(self, i: int) -> None:
        self.n += 1
        if self.n >= self._target:
            self._reached.set()

    async def wait(self, n: int, deadline: float) -> bool:
        """Until ``n`` tasks have started (True) or ``deadline`` (perf_counter) passes (False)."""
        self._target = n
        if self.n >= n:
            return True
        try:
            await asyncio.wait_for(self._reached.wait(), max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            return False
        return True


def drained(
    jobs: int, seconds: float, finished: bool, worker_cpu: float, pg_cpu: float | None
) -> dict[str, Any]:
    """The figures of a drain: jobs/s, capped, CPU seconds per 1 000 jobs (worker, backends)."""
    return {
        "rate": jobs / seconds,
        "seconds": seconds,
        "jobs": jobs,
        "capped": not finished,
        "worker_cpu_per_1000": 1000 * worker_cpu / max(jobs, 1),
        "pg_cpu_per_1000": 1000 * pg_cpu / max(jobs, 1) if pg_cpu is not None else None,
    }
