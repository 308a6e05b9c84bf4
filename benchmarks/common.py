"""What the measurement scripts share: CPU time, memory, percentiles, preloading, counting."""

from __future__ import annotations

import asyncio
import contextlib
import math
import resource
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import psutil

import systems

MIB = 2**20


async def complete(conn: asyncpg.Connection, claim: Any) -> None:
    """Write one claim's completion as a worker's completer does (aioq's COMPLETE statement)."""
    from aioq.sql.outcomes import COMPLETE  # aioq's own cells only: peers' venvs need no aioq

    await COMPLETE.rows(conn, "aioq", [claim.id], [claim.number], "bench")


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


def resident(pids: list[int]) -> float:
    """MiB resident: this process's RSS, or the PSS summed over the given process trees.

    A worker of several processes (Celery's prefork pool) shares pages between them: the sum of
    their RSS would count those once per process, the sum of their PSS counts them once.
    """
    if not pids:
        return psutil.Process().memory_info().rss / MIB
    total = 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_full_info().pss
    return total / MIB


class Memory:
    """The worker's resident memory (``resident``) sampled while it runs; ``figures()`` sums up.

    In-process workers share the process with the harness (its enqueue client, the counters),
    the same for every system; ``start`` is the figure as the worker starts (after the preload).
    """

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (perf_counter, MiB)
        self.kind = "rss"

    @contextlib.asynccontextmanager
    async def watch(self, system: systems.System) -> AsyncIterator[None]:
        """Sample from now until the block ends (the worker's pids are read at each sample)."""
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                pids = system.worker_pids()
                self.sample(pids)
                # A process tree's PSS reads each process's smaps: once a second is enough.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0 if pids else self.interval)

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            stop.set()
            await task
            self.sample(system.worker_pids())

    def sample(self, pids: list[int]) -> float:
        self.kind = "pss" if pids else "rss"
        mib = resident(pids)
        self.samples.append((time.perf_counter(), mib))
        return mib

    def figures(self) -> dict[str, Any]:
        """start, peak and end MiB, and what was measured (``rss`` or ``pss`` of a tree)."""
        if not self.samples:
            return {}
        values = [m for _, m in self.samples]
        return {
            "mem_mb_start": values[0],
            "mem_mb_peak": max(values),
            "mem_mb_end": values[-1],
            "mem_kind": self.kind,
        }


class Histogram:
    """Latencies in ms, counted in fixed log-spaced buckets (1 % wide, 1 µs to 1 000 s): a
    run-long percentile without keeping every sample, so the harness's memory stays flat and
    the worker's RSS shows the worker's."""

    STEP = 1.01
    LOW_MS = 0.001

    def __init__(self) -> None:
        self.counts = [0] * (int(math.log(1e9) / math.log(self.STEP)) + 2)
        self.n = 0

    def add(self, ms: float) -> None:
        k = 0 if ms <= self.LOW_MS else int(math.log(ms / self.LOW_MS) / math.log(self.STEP)) + 1
        self.counts[min(k, len(self.counts) - 1)] += 1
        self.n += 1

    def pct(self, q: float) -> float | None:
        """The ``q`` quantile (the bucket's upper bound: at most 1 % high), None when empty."""
        if not self.n:
            return None
        rank, seen = min(self.n - 1, int(q * self.n)), 0
        for k, count in enumerate(self.counts):
            seen += count
            if seen > rank:
                return self.LOW_MS * self.STEP**k
        return None


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mm = sum(m for _, m in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if not var:
        return None
    return 60 * sum((t - mt) * (m - mm) for t, m in samples) / var
