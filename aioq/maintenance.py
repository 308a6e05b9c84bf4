"""Retention: the pruner that deletes old archived and dead jobs in bounded batches."""

from __future__ import annotations

import logging

from aioq._service import repeat
from aioq.store import Executor, Store

__all__ = ("Pruner",)

logger = logging.getLogger(__name__)


class Pruner:
    """Deletes archived jobs and dead jobs past their retention, one bounded batch per table.

    A retention of None keeps those rows forever. Each pass runs at most one DELETE of at most
    ``batch_size`` rows per table, picked with SKIP LOCKED, so no statement runs long, no lock
    piles up and every worker can run a pruner. A dead job's age counts from its ``run_at``,
    which burial (by the worker or the reaper) sets to the time the job died.
    """

    def __init__(
        self,
        *,
        store: Store,
        db: Executor,
        archive_retention: float | None,
        dead_retention: float | None,
        interval: float,
        batch_size: int,
    ) -> None:
        self.store = store
        self.db = db
        self.archive_retention = archive_retention
        self.dead_retention = dead_retention
        self.interval = interval
        self.batch_size = batch_size
        self._full = False  # the last pass filled a batch: more rows may be due

    async def run_once(self) -> int:
        """Delete up to one batch of archived and one batch of dead jobs; return how many."""
        archived = dead = 0
        if self.archive_retention is not None:
            archived = await self.store.prune_archive(
                self.db, self.archive_retention, self.batch_size
            )
        if self.dead_retention is not None:
            dead = await self.store.prune_dead(self.db, self.dead_retention, self.batch_size)
        self._full = archived >= self.batch_size or dead >= self.batch_size
        if archived or dead:
            logger.info(
                "pruner: deleted %d archived and %d dead jobs",
                archived,
                dead,
                extra={"archived": archived, "dead": dead},
            )
        return archived + dead

    async def run(self) -> None:
        """Prune until cancelled; at once again while batches come back full."""

        async def step() -> bool:
            await self.run_once()
            return self._full

        await repeat("pruner", step, lambda: self.interval, logger)
