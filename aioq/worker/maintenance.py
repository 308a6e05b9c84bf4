"""Upkeep: the pruner (retention of archived and dead jobs) and the vacuumer (dead tuples)."""

from __future__ import annotations

import logging
import time

from aioq.db import Executor
from aioq.sql import Statement
from aioq.sql import maintenance as sql
from aioq.sql.workflows import PRUNE_WORKFLOWS
from aioq.worker.service import Service

__all__ = ("Pruner", "Vacuumer")

logger = logging.getLogger(__name__)


class Pruner(Service[int]):
    """Deletes archived, dead and cancelled jobs past their retention, expired results and
    ended unique windows.

    One bounded batch per kind per pass.

    A retention of None keeps those rows forever. A workflow run's steps, edges and results go
    ``workflow_retention`` seconds after the run was deferred, once none of its steps is left
    in the jobs table. Each pass runs at most one DELETE of at most
    ``batch_size`` rows per table, picked with SKIP LOCKED, so no statement runs long, no lock
    piles up and every worker can run a pruner. A dead job's age counts from its ``run_at``,
    which burial (by the worker or the reaper) sets to the time the job died.
    """

    name = "pruner"

    def __init__(
        self,
        *,
        schema: str,
        db: Executor,
        archive_retention: float | None,
        dead_retention: float | None,
        interval: float,
        workflow_retention: float | None,
        batch_size: int,
    ) -> None:
        super().__init__()
        self.schema = schema
        self.db = db
        self.archive_retention = archive_retention
        self.dead_retention = dead_retention
        self.workflow_retention = workflow_retention
        self.prune_interval = interval
        self.batch_size = batch_size
        self._full = False  # the last pass filled a batch: more rows may be due

    async def run_once(self) -> int:
        """Delete up to one batch of each kind of expired row; return how many."""
        db, schema, batch = self.db, self.schema, self.batch_size
        archived = dead = cancelled = 0
        if self.archive_retention is not None:
            archived = await _count(sql.PRUNE_ARCHIVE, db, schema, self.archive_retention, batch)
        if self.dead_retention is not None:
            ended = (self.dead_retention, batch)
            dead = await _count(sql.PRUNE_ENDED, db, schema, *ended, "dead")
            # Cancelled jobs are kept like dead ones, for as long.
            cancelled = await _count(sql.PRUNE_ENDED, db, schema, *ended, "cancelled")
        results = await _count(sql.PRUNE_RESULTS, db, schema, batch)
        uniques = await _count(sql.PRUNE_UNIQUES, db, schema, batch)  # ended unique_for windows
        runs = 0
        if self.workflow_retention is not None:
            runs = await _count(PRUNE_WORKFLOWS, db, schema, self.workflow_retention, batch)
        self._full = max(archived, dead, cancelled, results, uniques, runs) >= self.batch_size
        if archived or dead or cancelled or results:
            logger.info(
                "pruner: deleted %d archived, %d dead and %d cancelled jobs, %d expired results",
                archived,
                dead,
                cancelled,
                results,
                extra={
                    "archived": archived,
                    "dead": dead,
                    "cancelled": cancelled,
                    "results": results,
                },
            )
        if uniques or runs:
            logger.debug("pruner: deleted %d ended unique windows, %d workflow runs", uniques, runs)
        return archived + dead + cancelled + results + uniques + runs

    def interval(self) -> float:
        """Seconds between passes."""
        return self.prune_interval

    def busy(self, result: int) -> bool:
        """A batch came back full: more rows may be due."""
        return self._full


async def _count(statement: Statement[int], db: Executor, schema: str, *args: object) -> int:
    """Run one prune; return the rows it deleted."""
    return await statement.row(db, schema, *args) or 0


# The planner's statistics of the jobs table are stale when they were taken of an empty table
# (or never) and it now holds at least STALE_ROWS rows, or when it has grown past STALE_GROWTH
# times the pages they saw (and past STALE_MIN_PAGES): see Vacuumer.
STALE_ROWS = 10_000
STALE_GROWTH = 4
STALE_MIN_PAGES = 1_000


def stale(tuples: sql.DeadTuples) -> bool:
    """Whether the planner's idea of the jobs table is far from what it holds now."""
    if tuples.reltuples <= 0 and tuples.live >= STALE_ROWS:
        return True
    return tuples.pages >= STALE_MIN_PAGES and tuples.pages > STALE_GROWTH * tuples.relpages


class Vacuumer(Service[bool]):
    """Vacuums the jobs table once its dead tuples pass a threshold, without waiting for autovacuum.

    Every claim and every completion leaves a dead tuple, and the claim's index scan steps over
    the entries of jobs already claimed until a vacuum removes them. Autovacuum looks at a
    database once per ``autovacuum_naptime`` (60 s by default): at thousands of jobs a second
    that is hundreds of thousands of dead tuples, and claims slow down until the backlog
    grows. A cheap statistics read every ``interval`` decides; ``VACUUM (SKIP_LOCKED)`` lets one
    session vacuum at a time with no coordination. Only the table's owner may vacuum it: for
    any other role the vacuumer says so once and leaves the table to autovacuum.

    Below the threshold, it analyses the table when the planner's statistics of it are stale
    (:func:`stale`): taken of an empty table, or never, while a backlog has built up. A
    prepared statement's generic plan made then (the table believed empty) found the claimed
    rows by a sequential scan of the whole table, on every claim, until something renewed the
    statistics: the claims slowed down as the backlog grew, the jobs done (and so the dead
    tuples) came in slower, and the threshold was reached later and later
    (docs/architecture.md, "Cleanup").
    """

    name = "vacuumer"

    def __init__(self, *, schema: str, db: Executor, threshold: int, interval: float) -> None:
        super().__init__()
        self.schema = schema
        self.db = db
        self.threshold = threshold
        self.check_interval = interval
        self.allowed = True

    async def run_once(self) -> bool:
        """Vacuum the jobs table if it holds more dead tuples than the threshold, else analyse
        it if its statistics are stale; say if it did either."""
        tuples = await sql.JOBS_DEAD_TUPLES.row(self.db, self.schema)
        assert tuples is not None  # one row: the table exists
        dead = tuples.dead
        if not tuples.owner:
            if self.allowed:  # say it once
                logger.info(
                    "vacuumer: this role does not own %s.jobs; autovacuum alone cleans it",
                    self.schema,
                )
            self.allowed = False
            return False
        if dead < self.threshold:
            if not stale(tuples):
                return False
            started = time.monotonic()
            await sql.ANALYZE_JOBS.run(self.db, self.schema, within=sql.VACUUM_TIMEOUT)
            logger.info(
                "vacuumer: analysed %s.jobs (%d rows; the planner saw %.0f in %d pages, it has"
                " %d) in %.2fs",
                self.schema,
                tuples.live,
                tuples.reltuples,
                tuples.relpages,
                tuples.pages,
                time.monotonic() - started,
                extra={"live_tuples": tuples.live},
            )
            return True
        started = time.monotonic()
        # Not the pool's command timeout (meant for statements on a silent connection): a big
        # table's VACUUM may take longer, and cancelled it would never finish.
        await sql.VACUUM_JOBS.run(self.db, self.schema, within=sql.VACUUM_TIMEOUT)
        logger.info(
            "vacuumer: vacuumed %s.jobs (%d dead tuples) in %.2fs",
            self.schema,
            dead,
            time.monotonic() - started,
            extra={"dead_tuples": dead},
        )
        return True

    def interval(self) -> float:
        """Seconds between checks."""
        return self.check_interval
