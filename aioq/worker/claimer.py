"""How a worker claims: its unlimited queues in one statement, each limited queue in its turn.

docs/architecture.md, "The claim" and "Limits". A limited queue's claim locks the queue's row,
then counts its running jobs and recent claims in a fresh snapshot and takes no more than the
room left (aioq.sql.limits.CLAIM_LIMITED): PostgreSQL enforces the limits, nothing is counted
in Python. Which of the worker's queues are limited is read at most every ``refresh`` seconds
(and at once when aioq.admin.set_queue notifies a change); a queue wrongly thought limited costs a
turn, never a broken limit.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

import asyncpg

from aioq.db import Connection, Executor
from aioq.job import Claim
from aioq.sql import limits as sql
from aioq.sql.jobs import CLAIM_ONE_QUEUE, CLAIM_QUEUES, ClaimJobs, ClaimQueues
from aioq.sql.outcomes import RELEASE_WORKER

__all__ = ("DEFAULT_REFRESH", "Claimer")

logger = logging.getLogger(__name__)

DEFAULT_REFRESH = 1.0
# A worker remembers at most this many names of tasks it does not know (beyond, it forgets the
# oldest: their waiting jobs cost it one more claim each).
MAX_UNKNOWN = 1000
MIN_WAKE = 0.01  # the shortest wait for a rate window to move on
RATE_SLOTS = 10  # a rate window is counted in slots of a tenth of its period (CLAIM_LIMITED)


class Claimer:
    """The claim statements of one worker on its queues, and the release of its orphans."""

    def __init__(
        self,
        *,
        schema: str,
        db: Executor,
        queues: Sequence[str],
        worker_id: str,
        ring: Callable[[], None],
        refresh: float = DEFAULT_REFRESH,
        unknown_task_grace: float = 0.0,
    ) -> None:
        self.schema = schema
        self.db = db
        self.queues = list(queues)
        self.worker_id = worker_id
        self.ring = ring
        self.refresh = refresh
        # The tasks this worker found it does not know (in the order found): their jobs that
        # wait for a worker that knows them are left to such workers until they have waited
        # unknown_task_grace (docs/architecture.md, "Unknown tasks").
        self.unknown: dict[str, None] = {}
        self.unknown_task_grace = unknown_task_grace
        self.limited: frozenset[str] = frozenset()
        self.slots: dict[str, float] = {}  # rate-limited queue -> seconds per counting slot
        # Seconds until a rate-limited queue that had no room may have some: the producer
        # looks again then (no doorbell rings when a rate window moves on).
        self.wake_after = math.inf
        # Limited queues whose last claim took all the room their limits left (paused, at
        # max_running, the rate spent): the worker does not arm their doorbell (claimable()).
        self.blocked: frozenset[str] = frozenset()
        self._read_at = -math.inf
        self._old_schema = False
        # Whether the rows under our worker id are ours to release: not once another live
        # worker took the id (docs/architecture.md, "Worker ids").
        self.by_id = True

    async def claim(self, limit: int) -> list[Claim]:
        """Claim up to ``limit`` jobs of the worker's queues, within their limits."""
        self.wake_after = math.inf
        if time.monotonic() - self._read_at >= self.refresh:
            await self.read()
        if not self.limited:
            return await self._claim(self.db, self.queues, limit)
        claims: list[Claim] = []
        for queue in self.queues:
            if queue in self.limited and len(claims) < limit:
                wanted = limit - len(claims)
                got, rate_room, room = await self._claim_limited(queue, wanted)
                claims += got
                if room is not None and len(got) >= room:
                    self.blocked |= {queue}
                else:
                    self.blocked -= {queue}
                if rate_room is not None and len(got) == rate_room < wanted:
                    # The rate held claims back (not a lack of jobs): look again when the
                    # oldest counted slot may have left the window.
                    slot = self.slots.get(queue, DEFAULT_REFRESH)
                    self.wake_after = min(self.wake_after, max(slot, MIN_WAKE))
        free = [q for q in self.queues if q not in self.limited]
        if free and len(claims) < limit:
            claims += await self._claim(self.db, free, limit - len(claims))
        return claims

    def learn_unknown(self, task: str) -> bool:
        """Remember that this worker does not know ``task``; return whether it is news."""
        if task in self.unknown:
            return False
        if len(self.unknown) >= MAX_UNKNOWN:
            del self.unknown[next(iter(self.unknown))]
        self.unknown[task] = None
        return True

    def claimable(self) -> list[str]:
        """The worker's queues it can claim from now, as far as its last claims saw: the
        doorbell is armed for these only (docs/architecture.md, "The doorbell")."""
        if not self.blocked:
            return self.queues
        return [q for q in self.queues if q not in self.blocked]

    async def release(self, keep: Sequence[int] = ()) -> list[int]:
        """Give back every row running under this worker's id but the jobs in ``keep``.

        After a claim whose reply was lost (its rows are ours, but no claim of ours knows
        them) and on shutdown; the attempts are refunded. Return the ids released (none once
        the id is another worker's).
        """
        if not self.by_id:
            return []
        return sorted(await RELEASE_WORKER.rows(self.db, self.schema, self.worker_id, list(keep)))

    async def read(self) -> None:
        """Read which of the worker's queues are limited or paused now."""
        try:
            rows = await sql.LIMITED_QUEUES.rows(self.db, self.schema, self.queues)
        except asyncpg.UndefinedTableError:
            # A schema from before queue limits: no queue can have one. Claim as before, and
            # say once what to run (a missing grant, by contrast, fails the claim loudly).
            if not self._old_schema:
                logger.warning(
                    "schema %s has no queues table (older than this aioq): queue limits are"
                    " off until `aioq schema apply` upgrades it",
                    self.schema,
                )
            self._old_schema = True
            rows = []
        limited = frozenset(row.name for row in rows)
        if limited != self.limited:
            logger.debug("limited queues now: %s", ", ".join(sorted(limited)) or "none")
        self.limited = limited
        self.blocked &= limited
        self.slots = {
            row.name: row.rate_period / RATE_SLOTS for row in rows if row.rate_period is not None
        }
        self._read_at = time.monotonic()

    def _claiming(self, queue: str, limit: int) -> ClaimJobs:
        return ClaimJobs(
            queue=queue,
            limit=limit,
            worker=self.worker_id,
            unknown=list(self.unknown),
            grace=self.unknown_task_grace,
        )

    async def _claim(self, db: Executor, queues: Sequence[str], limit: int) -> list[Claim]:
        if len(queues) == 1:
            claims = await CLAIM_ONE_QUEUE.rows(db, self.schema, self._claiming(queues[0], limit))
        else:
            claiming = ClaimQueues(
                queues=list(queues),
                limit=limit,
                worker=self.worker_id,
                unknown=list(self.unknown),
                grace=self.unknown_task_grace,
            )
            claims = await CLAIM_QUEUES.rows(db, self.schema, claiming)
        # UPDATE ... RETURNING keeps no order: the consumers start them in claim order.
        claims.sort(key=lambda c: (-c.priority, c.id))
        return claims

    async def _claim_limited(
        self, queue: str, limit: int
    ) -> tuple[list[Claim], int | None, int | None]:
        if isinstance(self.db, asyncpg.Pool):
            async with self.db.acquire() as conn:
                return await self._claim_in_turn(conn, queue, limit)
        return await self._claim_in_turn(self.db, queue, limit)

    async def _claim_in_turn(
        self, conn: Connection, queue: str, limit: int
    ) -> tuple[list[Claim], int | None, int | None]:
        """Claims, what the rate allowed (None: no rate), what the limits allowed (None: no
        limit)."""
        async with conn.transaction():
            limited = await sql.LOCK_QUEUE.row(conn, self.schema, queue)
            if limited:
                rows = await sql.CLAIM_LIMITED.rows(conn, self.schema, self._claiming(queue, limit))
                claims = [claim for claim, _, _ in rows if claim is not None]
                if not rows:  # the queue's row went meanwhile: no limit
                    return claims, None, None
                return claims, rows[0][1], rows[0][2]
            # Its limits were removed since we last looked: a plain claim, in the same turn.
            return await self._claim(conn, [queue], limit), None, None

    def changed(self) -> None:
        """Limits changed somewhere (a notification): read them before the next claim."""
        self._read_at = -math.inf
        self.ring()

    def written(self, queues: Iterable[str]) -> None:
        """After outcomes of jobs of these queues are written: a limited one has room again,
        so claim at once."""
        if self.limited and any(q in self.limited for q in queues):
            self.ring()
