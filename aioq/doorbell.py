"""The doorbell's Python side, in one place; its statements are :mod:`aioq.sql.doorbell`.

docs/architecture.md, "The doorbell". NOTIFY is a doorbell, polling the guarantee: a ring says
"a queue may have jobs ready", never which. Three things ring or listen:

- :func:`ring` and :func:`ring_sync`: an application rings a queue for jobs it inserted with
  raw SQL. aioq's own statements ring in SQL, with no round trip of their own (the ``rang``
  CTE, :func:`aioq.sql.doorbell.ring`).
- :class:`Watch`: a worker's doorbell locks on its LISTEN session. Before its producer sleeps it
  arms them (standby, duty, or an insert in flight seen: look again), and it disarms when rung
  or when its session ends. The listener service (:mod:`aioq.worker.notifier`) owns the
  session and calls it.
- :class:`Doorbell`: the wake-up inside a worker, rung by the listener (a notification for one
  of its queues) and by the worker itself; the producer waits on it between claims.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Collection, Iterable

import anyio
import asyncpg

from aioq.db import Target, executor
from aioq.dbapi import SyncTarget
from aioq.dbapi import executor as sync_executor
from aioq.options import check_queue
from aioq.sql import DEFAULT_SCHEMA
from aioq.sql import doorbell as sql

__all__ = ("ANY_QUEUE", "MAX_ARMED", "Armed", "Doorbell", "Watch", "ring", "ring_sync")

logger = logging.getLogger(__name__)


async def ring(conn: Target, queue: str, *, schema: str = DEFAULT_SCHEMA) -> None:
    """Ring a queue's doorbell for jobs inserted with raw SQL (aioq's own inserts ring).

    Call it in the transaction that inserted the rows, or after its commit: a worker on duty
    for the queue is woken at once (at the commit), instead of at its next poll. Like
    aioq's inserts, it notifies only when a worker sleeps on the queue (docs/architecture.md,
    "The doorbell"). ``conn``: anything :meth:`Task.defer` takes.
    """
    check_queue("queue", queue)
    await sql.RING.run(await executor(conn), schema, queue)


def ring_sync(conn: SyncTarget, queue: str, *, schema: str = DEFAULT_SCHEMA) -> None:
    """Ring a queue's doorbell for jobs inserted with raw SQL, as :func:`ring` does, from
    synchronous code (in the inserting transaction, or after its commit)."""
    check_queue("queue", queue)
    sql.RING.rows_sync(sync_executor(conn), schema, queue)


MAX_ARMED = 32
"""The most queues a worker arms one by one (two locks each: standby and duty); a worker that
can claim from more arms the wildcard instead (two locks), so its LISTEN session holds at
most 64 advisory locks whatever the number of queues: no more than PostgreSQL's default
``max_locks_per_transaction``, the share of the lock table the server sizes per connection."""

ANY_QUEUE = ""
"""The wildcard's name (no queue has it): a worker on duty for it is rung by an insert into
any queue."""

FIRST_PAUSE = 0.01
"""The first pause of a worker armed on the wildcard that was rung for a queue it does not
watch, before it arms the wildcard again (doubling per such ring, up to :data:`LONGEST_PAUSE`
and never beyond the worker's poll interval)."""

LONGEST_PAUSE = 30.0


class Armed(enum.Enum):
    """What the producer does after :meth:`Watch.arm`, before it sleeps."""

    SLEEP = "sleep"
    """Every insert into our queues rings (or none can: polling covers it): sleep."""
    LOOK = "look"
    """Armed just now: an insert committed before could have skipped the ring: look once more.
    Also after a ring that came since the last arm: the producer looks, the listener disarms."""
    LOOK_AGAIN = "look again"
    """As LOOK, and an insert that may not ring was in flight: look again after a pause."""
    LATER = "later"
    """Not armed: the wildcard rang for a queue we do not watch; wait :meth:`Watch.later`
    seconds (or a ring), then arm again."""


class Watch:
    """A worker's doorbell locks on its LISTEN session (:mod:`aioq.sql.doorbell`): standby of
    these names, duty of those, the names whose duty a worker may not take yet and the queues
    probed under the wildcard that had an insert in flight (see :meth:`arm`).

    A name is a queue's, or :data:`ANY_QUEUE` (the wildcard), armed instead of the queues when
    the worker can claim from more than :data:`MAX_ARMED` of them.

    The session holds the locks, so a worker that dies stops the ringing with it. One statement
    at a time runs on the session: :attr:`talk` (the listener's keepalive ping takes it too).
    """

    def __init__(self, *, schema: str, queues: Collection[str], within: float) -> None:
        self.schema = schema
        self.queues = frozenset(queues)
        self.within = within  # each statement's timeout: the listener's keepalive
        self.handover = sql.handover_channel(schema)
        self.arms = 0  # how many times the doorbell was armed (a statement each, tests aside)
        self.talk = anyio.Lock()
        self.conn: asyncpg.Connection | None = None  # the LISTEN session, while it is up
        self.armed = False  # the producer waits for a ring
        self.standby: frozenset[str] = frozenset()
        self.duty: frozenset[str] = frozenset()
        self.in_flight: frozenset[str] = frozenset()  # names whose duty may not be taken yet
        self.watched: frozenset[str] = frozenset()  # the queues the wildcard is armed for
        self.unsure: frozenset[str] = frozenset()  # of those, probed with an insert in flight
        self.keys: dict[int, str] = {}  # duty key -> name, of the names on standby
        self.arming = False  # arm() runs: a ring meanwhile leaves the doorbell unarmed
        self.rang = False  # a ring came while arming
        self.pause = 0.0  # the wildcard's pause after a ring for a queue it does not watch
        self.quiet_until = 0.0  # time.monotonic() before which the wildcard is not armed
        self.failing = False  # the last arm failed (warned once per streak)

    @property
    def watching(self) -> frozenset[str]:
        """The queues whose rings the producer sleeps for."""
        return self.watched if ANY_QUEUE in self.standby else self.standby

    def rung(self, queue: str) -> bool:
        """A ring for ``queue`` arrived; return True when the listener must disarm the doorbell
        (one ring per sleep: inserts stop ringing once the locks are released).

        A ring for one of our queues ends the sleep. Armed on the wildcard, every insert into
        any queue rings while we are on duty for it: a ring for a queue we do not watch (one of
        ours we cannot claim from, or not ours) ends the wildcard's duty too, and the wildcard
        is armed again only after a pause (doubling while such rings go on), so that a busy
        queue we do not serve costs one notification per pause, not one per commit.
        """
        if not (self.armed or self.arming):
            return False
        wildcard = ANY_QUEUE in self.duty
        if queue in self.watching:
            self.pause = 0.0
        elif wildcard:
            self.pause = min(2 * self.pause or FIRST_PAUSE, LONGEST_PAUSE)
            self.quiet_until = time.monotonic() + self.pause
        elif queue not in self.queues:
            return False  # another worker's ring
        self.armed = False
        self.rang = self.arming
        return True

    def handed(self, key: int) -> bool:
        """A worker left duty for the name of ``key`` (a hand-over): return True, as
        :meth:`rung` does, when we slept on its watch: the producer looks and arms again."""
        if key not in self.keys or not (self.armed or self.arming):
            return False
        self.armed = False
        self.rang = self.arming
        return True

    @property
    def resting(self) -> bool:
        """Locks are held while nobody sleeps on them: disarm, or inserts ring for nothing."""
        return bool(self.standby) and not self.armed and not self.arming

    def later(self) -> float:
        """Seconds until the wildcard may be armed again (after :data:`Armed.LATER`)."""
        return max(0.0, self.quiet_until - time.monotonic())

    async def arm(self, queues: Iterable[str] | None = None) -> Armed:
        """Make inserts into our queues ring, before the producer sleeps ("The doorbell").

        ``queues``: those of our queues the worker can claim from now (None: all). A queue it
        cannot claim from (paused, at its limit, its rate spent) is not armed: its inserts
        ring nobody, and the limits' own notification wakes the worker when it may claim again.
        Up to :data:`MAX_ARMED` queues are armed one by one, more through the wildcard.

        An insert that ran before the doorbell was armed did not ring: the producer must look
        for it once more (LOOK) before it sleeps; if such an insert was still in flight (its
        transaction open, its row invisible to that look), again once it may have committed
        (LOOK_AGAIN: the next arm() tests it again). SLEEP when every insert since the last
        look rings, or none can (no connection, or the arm failed: polling covers it). A ring
        that came since the last arm (or comes while arming) leaves it unarmed: LOOK.
        """
        wanted = self.queues if queues is None else self.queues.intersection(queues)
        if len(wanted) > MAX_ARMED:
            names, watched = frozenset({ANY_QUEUE}), wanted
        else:
            names, watched = wanted, frozenset()
        conn = self.conn
        if conn is None:
            return Armed.SLEEP
        if self.resting:
            return Armed.LOOK  # rung since the last arm: the producer looks, the listener disarms
        if (
            self.armed
            and not self.in_flight
            and not self.unsure
            and names == self.standby
            and watched == self.watched
        ):
            return Armed.SLEEP
        paused = ANY_QUEUE in names and self.later() > 0
        if paused:
            names, watched = frozenset(), frozenset()
        self.arming, self.rang = True, False
        try:
            # Under the lock: a disarm in flight finishes first, and we then see it.
            async with self.talk:
                if self.conn is not conn:
                    return Armed.SLEEP  # lost meanwhile
                try:
                    looking = await self._arm(conn, names, watched)
                except Exception as exc:
                    await self._failed(conn, names, exc)
                    return Armed.SLEEP
                if paused:
                    return Armed.LATER
        finally:
            self.arming = False
        if not self.armed:
            return Armed.LOOK  # rung meanwhile: the producer looks, the listener disarms
        if looking is None:
            return Armed.SLEEP
        return Armed.LOOK_AGAIN if looking else Armed.LOOK

    async def _arm(
        self, conn: asyncpg.Connection, names: frozenset[str], watched: frozenset[str]
    ) -> bool | None:
        """Hold the locks of ``names`` (and probe ``watched`` under the wildcard), releasing
        the others; return whether an insert that may not ring is in flight (None: nothing
        was released since the last arm, every insert since has rung)."""
        dropped = self.standby - names
        if dropped:
            await sql.DISARM_DOORBELL.run(
                conn,
                self.schema,
                sorted(self.duty & dropped),
                sorted(dropped),
                self.handover,
                within=self.within,
            )
            self._left(dropped)
        fresh = names - self.standby
        tried = fresh | (self.in_flight & names)
        # Every watched queue is probed when the wildcard is tried (an insert that tested it
        # before it was held may be in flight), else the new ones and those in flight.
        probe = (
            watched if ANY_QUEUE in tried else (watched - self.watched) | (self.unsure & watched)
        )
        if not tried and not probe:
            self.watched = watched
            self.armed = not self.rang
            return None
        found = await sql.ARM_DOORBELL.rows(
            conn,
            self.schema,
            sorted(fresh),
            sorted(tried),
            sorted(probe),
            self.handover,
            within=self.within,
        )
        if fresh:
            self.arms += 1
        self.standby |= fresh
        self.keys.update((d.key, d.queue) for d in found if d.queue in fresh)
        self.duty |= {d.queue for d in found if d.duty and d.queue in tried}
        self.in_flight = frozenset(d.queue for d in found if d.queue in tried and not d.covered)
        self.unsure = ((self.unsure & watched) - probe) | {
            d.queue for d in found if d.queue in probe and not d.covered
        }
        self.watched = watched
        if self.failing:
            logger.info("the doorbell is armed again")
            self.failing = False
        self.armed = not self.rang
        return bool(self.in_flight or self.unsure)

    async def _failed(
        self, conn: asyncpg.Connection, names: frozenset[str], exc: Exception
    ) -> None:
        """An arm failed (the connection is going, the server is out of lock memory, a
        timeout): the producer polls. Locks the failed statement took stay with the session
        (advisory locks ignore rollbacks): release them all, and hand over every name we were
        or may have gone on duty for; if even that fails, end the session (the listener
        reconnects, and the server drops its locks)."""
        level = logging.DEBUG if self.failing else logging.WARNING
        logger.log(
            level,
            "arming the doorbell failed (%s: %s); polling meanwhile",
            type(exc).__name__,
            exc,
        )
        self.failing = True
        candidates = sorted(self.duty | names)
        self.armed = False
        self._left(self.standby)
        if self.conn is not conn:
            return  # gone, and its locks with it
        try:
            with anyio.CancelScope(shield=True):
                await sql.RESET_DOORBELL.run(
                    conn, self.schema, candidates, self.handover, within=self.within
                )
        except Exception:
            conn.terminate()

    def _left(self, names: frozenset[str]) -> None:
        """Duty and standby of ``names`` were released."""
        self.standby -= names
        self.duty -= names
        self.in_flight -= names
        self.keys = {k: n for k, n in self.keys.items() if n not in names}
        if ANY_QUEUE in names:
            self.watched = self.unsure = frozenset()

    async def disarm(self, conn: asyncpg.Connection) -> None:
        """Leave duty and standby on every name (ringing those that slept on our watch)."""
        await sql.DISARM_DOORBELL.run(
            conn,
            self.schema,
            sorted(self.duty),
            sorted(self.standby),
            self.handover,
            within=self.within,
        )
        self._left(self.standby)

    def begin(self, conn: asyncpg.Connection) -> None:
        """A LISTEN session is up: the doorbell may be armed on it."""
        self.conn = conn

    def end(self) -> bool:
        """The session is ending: nothing more is armed on it. Return whether it is on duty
        for a name (then :meth:`disarm` rings the workers that slept on its watch)."""
        self.conn = None
        self.armed = False
        return bool(self.duty)

    def forget(self) -> None:
        """The session is gone, and its locks with it."""
        self._left(self.standby)


class Doorbell:
    """A wake-up that is not lost: a ring while nobody waits wakes the next wait at once."""

    def __init__(self) -> None:
        self._rung = anyio.Event()

    def ring(self) -> None:
        """Wake the producer (new jobs may be ready)."""
        self._rung.set()

    async def wait(self, seconds: float) -> bool:
        """Wait for a ring, at most ``seconds``; return True if it rang."""
        with anyio.move_on_after(seconds):
            await self._rung.wait()
        rang = self._rung.is_set()
        if rang:
            self._rung = anyio.Event()
        return rang
