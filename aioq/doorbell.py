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
from collections.abc import Collection, Iterable

import anyio
import asyncpg

from aioq.db import Target, executor
from aioq.dbapi import SyncTarget
from aioq.dbapi import executor as sync_executor
from aioq.options import check_queue
from aioq.sql import DEFAULT_SCHEMA
from aioq.sql import doorbell as sql

__all__ = ("Armed", "Doorbell", "Watch", "ring", "ring_sync")

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


class Armed(enum.Enum):
    """What the producer does after :meth:`Watch.arm`, before it sleeps."""

    SLEEP = "sleep"
    """Every insert into our queues rings (or none can: polling covers it): sleep."""
    LOOK = "look"
    """Armed just now: an insert committed before could have skipped the ring: look once more."""
    LOOK_AGAIN = "look again"
    """As LOOK, and an insert that may not ring was in flight: look again after a pause."""


class Watch:
    """A worker's doorbell locks on its LISTEN session (:mod:`aioq.sql.doorbell`): standby of
    these queues, duty of those, and the queues whose duty a worker may not take yet (an insert
    is in flight, see :meth:`arm`).

    The session holds the locks, so a worker that dies stops the ringing with it. One statement
    at a time runs on the session: :attr:`talk` (the listener's keepalive ping takes it too).
    """

    def __init__(self, *, schema: str, queues: Collection[str], within: float) -> None:
        self.schema = schema
        self.queues = frozenset(queues)
        self.within = within  # each statement's timeout: the listener's keepalive
        self.arms = 0  # how many times the doorbell was armed (a statement each, tests aside)
        self.talk = anyio.Lock()
        self.conn: asyncpg.Connection | None = None  # the LISTEN session, while it is up
        self.armed = False  # the producer waits for a ring
        self.standby: frozenset[str] = frozenset()
        self.duty: frozenset[str] = frozenset()
        self.in_flight: frozenset[str] = frozenset()

    def rung(self) -> bool:
        """A ring for one of our queues arrived; return True when the doorbell was armed: the
        listener then disarms it (one ring per sleep: inserts stop ringing once the locks are
        released)."""
        if not self.armed:
            return False
        self.armed = False
        return True

    @property
    def resting(self) -> bool:
        """Locks are held while nobody sleeps on them: disarm, or inserts ring for nothing."""
        return bool(self.standby) and not self.armed

    async def arm(self, queues: Iterable[str] | None = None) -> Armed:
        """Make inserts into our queues ring, before the producer sleeps ("The doorbell").

        ``queues``: those of our queues the worker can claim from now (None: all). A queue it
        cannot claim from (paused, at its limit, its rate spent) is not armed: its inserts
        ring nobody, and the limits' own notification wakes the worker when it may claim again.

        An insert that ran before the doorbell was armed did not ring: the producer must look
        for it once more (LOOK) before it sleeps; if such an insert was still in flight (its
        transaction open, its row invisible to that look), again once it may have committed
        (LOOK_AGAIN: the next arm() tests it again). SLEEP when every insert since the last
        look rings, or none can (no connection: polling covers it).
        """
        wanted = self.queues if queues is None else self.queues.intersection(queues)
        conn = self.conn
        if conn is None or (self.armed and not self.in_flight and wanted == self.standby):
            return Armed.SLEEP
        try:
            # Under the lock: a disarm in flight finishes first, and we then see it.
            async with self.talk:
                if self.conn is not conn:
                    return Armed.SLEEP  # lost meanwhile
                dropped = self.standby - wanted
                if dropped:
                    await sql.DISARM_DOORBELL.run(
                        conn,
                        self.schema,
                        sorted(dropped),
                        sorted(self.duty & dropped),
                        within=self.within,
                    )
                    self.standby -= dropped
                    self.duty -= dropped
                    self.in_flight -= dropped
                fresh = wanted - self.standby
                tried = fresh | self.in_flight
                if not tried:
                    # Never released since the last arm: every insert since has rung.
                    self.armed = True
                    return Armed.SLEEP
                found = await sql.ARM_DOORBELL.rows(
                    conn, self.schema, sorted(fresh), sorted(tried), within=self.within
                )
                if self.conn is not conn:
                    return Armed.SLEEP  # lost meanwhile, and the locks with it
                if fresh:
                    self.arms += 1
                self.standby |= fresh
                self.duty |= {d.queue for d in found if d.duty}
                self.in_flight = frozenset(d.queue for d in found if not d.covered)
                self.armed = True
                in_flight = bool(self.in_flight)
        except Exception as exc:
            # The connection is going: the listener notices and reconnects; polling covers it.
            logger.debug("arming the doorbell failed: %s: %s", type(exc).__name__, exc)
            return Armed.SLEEP
        return Armed.LOOK_AGAIN if in_flight else Armed.LOOK

    async def disarm(self, conn: asyncpg.Connection) -> None:
        """Leave duty and standby on every queue (ringing those that slept on our watch)."""
        await sql.DISARM_DOORBELL.run(
            conn, self.schema, sorted(self.standby), sorted(self.duty), within=self.within
        )
        self.standby = self.duty = self.in_flight = frozenset()

    def begin(self, conn: asyncpg.Connection) -> None:
        """A LISTEN session is up: the doorbell may be armed on it."""
        self.conn = conn

    def end(self) -> bool:
        """The session is ending: nothing more is armed on it. Return whether it is on duty
        for a queue (then :meth:`disarm` rings the workers that slept on its watch)."""
        self.conn = None
        self.armed = False
        return bool(self.duty)

    def forget(self) -> None:
        """The session is gone, and its locks with it."""
        self.standby = self.duty = self.in_flight = frozenset()


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
