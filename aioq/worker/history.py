"""Per-minute history of job outcomes, and the workers' own row: what the dashboard reads.

Completed jobs are deleted, so nothing in the jobs table says how many ran. Each worker counts
its outcomes per queue and task in memory (:class:`StatsRecorder`, fed by the completer) and a
:class:`StatsWriter` adds them to ``stats_history`` once a minute in one statement, which also
upserts the worker's row in ``workers``. Queue waits and run times are kept as bucket counts
(:data:`BUCKETS`), which add up across workers and minutes into percentiles.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import asyncpg
from anyio.abc import TaskStatus

from aioq.db import Executor
from aioq.job import Claim, OutcomeKind
from aioq.sql.history import FORGET_WORKER, HIST_WIDTH, PRUNE_STATS, RECORD_STATS, RecordStats
from aioq.worker.service import Service

__all__ = (
    "BUCKETS",
    "DEFAULT_STATS_INTERVAL",
    "DEFAULT_STATS_RETENTION",
    "StatsRecorder",
    "StatsWriter",
    "percentile",
)

logger = logging.getLogger(__name__)

DEFAULT_STATS_INTERVAL = 60.0
DEFAULT_STATS_RETENTION = 2 * 24 * 3600.0  # the dashboard shows the last day
PRUNE_BATCH = 5000

# Upper bounds in seconds; one more bucket counts everything above the last.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

assert len(BUCKETS) + 1 == HIST_WIDTH, "aioq.sql.history.HIST_WIDTH must match BUCKETS"

_COUNTED = {
    OutcomeKind.SUCCEEDED: "completed",
    OutcomeKind.RETRIED: "retried",
    OutcomeKind.DEAD: "dead",
}


def bucket(seconds: float) -> int:
    """Return the index of the bucket that counts ``seconds``."""
    return bisect.bisect_left(BUCKETS, seconds)


def percentile(hist: Sequence[int], fraction: float) -> float | None:
    """Return the upper bound of the bucket holding the ``fraction`` quantile (None if empty).

    Past the last bound the answer is ``inf``: "more than an hour".
    """
    total = sum(hist)
    if total == 0:
        return None
    rank = fraction * total
    seen = 0
    for index, count in enumerate(hist):
        seen += count
        if seen >= rank and count:
            return float(BUCKETS[index]) if index < len(BUCKETS) else math.inf
    return math.inf


@dataclass(slots=True)
class _Counts:
    completed: int = 0
    retried: int = 0
    dead: int = 0
    wait: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    run: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))


class StatsRecorder:
    """Counts this worker's outcomes per (queue, task) until the writer takes them."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], _Counts] = {}

    def observe(self, claim: Claim, kind: OutcomeKind, duration: float) -> None:
        """Count an outcome written under our claim (snoozes and releases are not outcomes)."""
        name = _COUNTED.get(kind)
        if name is None:
            return
        counts = self.counts.get((claim.queue, claim.task))
        if counts is None:
            counts = self.counts[claim.queue, claim.task] = _Counts()
        setattr(counts, name, getattr(counts, name) + 1)
        counts.wait[bucket(claim.waited)] += 1
        counts.run[bucket(duration)] += 1

    def take(self) -> dict[tuple[str, str], _Counts]:
        """Return and forget the counts so far."""
        counts, self.counts = self.counts, {}
        return counts

    def give_back(self, counts: dict[tuple[str, str], _Counts]) -> None:
        """Add counts that could not be written back, to try again with the next ones."""
        for key, old in counts.items():
            new = self.counts.setdefault(key, _Counts())
            new.completed += old.completed
            new.retried += old.retried
            new.dead += old.dead
            new.wait = [a + b for a, b in zip(new.wait, old.wait, strict=True)]
            new.run = [a + b for a, b in zip(new.run, old.run, strict=True)]


class StatsWriter(Service[int]):
    """Writes the recorder's counts and this worker's row once a ``interval``; prunes old rows."""

    name = "stats writer"

    def __init__(
        self,
        *,
        schema: str,
        db: Executor,
        recorder: StatsRecorder,
        worker_id: str,
        queues: Sequence[str],
        concurrency: int,
        interval: float = DEFAULT_STATS_INTERVAL,
        retention: float = DEFAULT_STATS_RETENTION,
    ) -> None:
        super().__init__()
        self.schema = schema
        self.db = db
        self.recorder = recorder
        self.worker_id = worker_id
        self.queues = list(queues)
        self.concurrency = concurrency
        self.write_interval = interval
        self.retention = retention
        self.missing = False  # no history tables (an old schema), or no right to write them

    def interval(self) -> float:
        """Seconds between writes."""
        return self.write_interval

    async def run_once(self) -> int:
        """Write the counts so far and this worker's row; prune a batch; return rows written."""
        if self.missing:
            self.recorder.take()  # nowhere to write them
            return 0
        try:
            return await self._write()
        except (asyncpg.UndefinedTableError, asyncpg.InsufficientPrivilegeError) as exc:
            # A schema from before the history migration, or a role granted only the older
            # tables: the worker runs on, without history.
            self.missing = True
            self.recorder.take()
            logger.warning(
                "worker %s writes no stats history (%s): run `aioq schema apply` as the owner,"
                " and grant the role the tables listed under Permissions in"
                " docs/operations-and-cli.md",
                self.worker_id,
                exc,
            )
            return 0

    async def _write(self) -> int:
        counts = self.recorder.take()
        keys = list(counts)
        try:
            # Shielded: a cancel (the worker stopping) must not interrupt the statement after
            # it committed, or the counts given back would be written twice.
            with anyio.CancelScope(shield=True):
                stats = RecordStats(
                    worker=self.worker_id,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    queues=self.queues,
                    concurrency=self.concurrency,
                    queue_names=[k[0] for k in keys],
                    tasks=[k[1] for k in keys],
                    completed=[counts[k].completed for k in keys],
                    retried=[counts[k].retried for k in keys],
                    dead=[counts[k].dead for k in keys],
                    wait_hist=[n for k in keys for n in counts[k].wait],
                    run_hist=[n for k in keys for n in counts[k].run],
                    buckets=HIST_WIDTH,
                )
                await RECORD_STATS.run(self.db, self.schema, stats)
        except Exception:
            self.recorder.give_back(counts)
            raise
        await PRUNE_STATS.run(self.db, self.schema, self.retention, PRUNE_BATCH)
        return len(keys)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write every ``interval`` until cancelled; then write the rest and remove our row."""
        try:
            await super().run(task_status=task_status)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                try:
                    if not self.missing:
                        await self._write()
                        await FORGET_WORKER.run(self.db, self.schema, self.worker_id)
                except Exception:
                    logger.warning("could not write the last stats of worker %s", self.worker_id)
