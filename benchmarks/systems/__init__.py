"""One adapter per queue system, all with the same small interface (see :class:`System`).

Each adapter uses its library's public API only: its task decorator on an async no-op, its
normal single and bulk enqueue calls, and its own worker run in this process.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

# The no-op task of every system calls this with its job number; measure.py sets it.
hook: Callable[[int], None] = lambda i: None  # noqa: E731


# The I/O-bound scenario sets these: the task then sleeps (an HTTP call's wait) and reports
# its end. The payload scenario sets ``blob``: an extra keyword argument of every job.
work_seconds = 0.0
done_hook: Callable[[int], None] = lambda i: None  # noqa: E731
blob: object = None
# The job number a workflow's fan-in reports (its steps are 0 .. n-1).
FAN_IN = -1
# A worker in another process reports when its task started (perf_counter: CLOCK_MONOTONIC, one
# clock for the host); its adapter sets this around the hook call, and hooks read clock().
stamp: float | None = None


def clock() -> float:
    """When the task being reported started: its own stamp, else now."""
    return stamp if stamp is not None else time.perf_counter()


def on_run(i: int) -> None:
    """Called by every system's no-op task: forwards to the current hook."""
    hook(i)


async def run_job(i: int) -> None:
    """The body of every system's task: the hook, then (I/O-bound runs) the simulated wait."""
    hook(i)
    if work_seconds:
        await asyncio.sleep(work_seconds)
        done_hook(i)


POSTGRES = ("aioq", "pgqueuer", "procrastinate", "chancy", "oban")
REFERENCE = "bare"  # not a system: the bare INSERT, for defer_one and defer_many
REDIS = ("saq", "arq", "celery")
ALL = POSTGRES + REDIS


class System:
    """What measure.py needs from a queue system. ``dsn`` is a PostgreSQL DSN or a Redis URL."""

    name = "?"
    backend = "postgres"
    # The table (in the system's own database) that holds its jobs: for the history scenario.
    bulk_api = "?"
    single_api = "?"
    # A fan-out of n steps with one fan-in (the workflow scenario); "" if not measured.
    workflow_api = ""
    # What ``concurrency`` becomes in the library (a per-worker cap, as aioq's), and the rest of
    # its configuration: RESULTS.md's table of how each system runs.
    concurrency_api = "?"
    mapping = ""
    # Set by a worker that runs in another process, once it was told to start consuming: the
    # clock starts there (its process start is not timed). ``cpu_at_start``: worker_cpu() then.
    consuming_since: float | None = None
    cpu_at_start = 0.0

    async def install(self, dsn: str) -> None:
        """Create the schema in a fresh database (done once, on the template)."""

    async def open(self, dsn: str) -> None:
        """Connect the enqueue side."""

    async def close(self) -> None:
        """Close what open() opened."""

    async def defer_one(self, i: int) -> None:
        """Enqueue one no-op job with the library's normal single call, its own transaction."""
        raise NotImplementedError

    async def defer_many(self, start: int, count: int) -> None:
        """Enqueue ``count`` no-op jobs in one call of the library's bulk API."""
        raise NotImplementedError

    async def remaining(self) -> int:
        """Jobs not yet done, as the database (or broker) shows it."""
        raise NotImplementedError

    shared_pool = False  # True: one opened adapter serves many concurrent defer_one calls

    def worker(
        self, concurrency: int, *, poll_interval: float = 1.0, listen: bool = True
    ) -> AbstractAsyncContextManager[None]:
        """Run the library's own worker (in this process, or one it starts) while open."""
        raise NotImplementedError

    def worker_pids(self) -> list[int]:
        """The worker's root processes when it runs outside this process (else none)."""
        return []

    def worker_cpu(self) -> float | None:
        """User+sys CPU seconds of the worker's process trees; None: the worker is this process."""
        pids = self.worker_pids()
        if not pids:
            return None
        from cpu import tree_cpu

        return sum(tree_cpu(p) for p in pids)

    async def run_workflow(self, n: int) -> None:
        """Submit ``n`` steps that each call run_job(i) and one fan-in that calls run_job(-1)
        once every step has run (the workflow scenario; a running worker executes them)."""
        raise NotImplementedError


def load(name: str) -> System:
    """Return the adapter of a system by name."""
    module = importlib.import_module(f"systems.sys_{name}")
    return module.Adapter()  # type: ignore[no-any-return]


__all__ = ("ALL", "POSTGRES", "REDIS", "AsyncIterator", "System", "load", "on_run", "run_job")
