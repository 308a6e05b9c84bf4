"""The worker's one LISTEN connection: a doorbell per served queue, reconnected with backoff."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import anyio
import asyncpg

from aioq.backoff import Backoff
from aioq.sql import LIMITS_CHANGED, channel_name
from aioq.sql import doorbell as sql
from aioq.sql.admin import PING
from aioq.worker.service import Service

__all__ = ("Armed", "Listener")

logger = logging.getLogger(__name__)


class Armed(enum.Enum):
    """What the producer does after :meth:`Listener.arm`, before it sleeps (docs/architecture.md, "The doorbell")."""

    SLEEP = "sleep"
    """Every insert into our queues rings (or none can: polling covers it): sleep."""
    LOOK = "look"
    """Armed just now: an insert committed before could have skipped the ring: look once more."""
    LOOK_AGAIN = "look again"
    """As LOOK, and an insert that may not ring was in flight: look again after a pause."""


class Listener(Service[None]):
    """LISTENs on the schema's channel and rings the doorbell for notifications of our queues.

    Notifications are only a hint: polling goes on while this connection is down, and the
    doorbell rings on every (re)connect so the producer polls at once.
    """

    def __init__(
        self,
        *,
        connect: Callable[[], Any],
        queues: Collection[str],
        ring: Callable[[], None],
        schema: str,
        keepalive: float = 5.0,
        control: Mapping[str, Callable[[str], None]] | None = None,
        on_limits: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.connect = connect
        self.schema = schema
        self.queues_list = sorted(set(queues))
        self.channel = channel_name(schema)
        self.queues = frozenset(queues)
        self.ring = ring
        self.keepalive = keepalive
        # More channels on the same connection (the control channel, "Job control"), with the
        # handler each notification's payload goes to.
        self.control = dict(control or {})
        self.connected = anyio.Event()
        self.connections = 0  # how many times a LISTEN was established
        self.on_limits = on_limits  # aioq.set_queue changed a queue's limits
        self.arms = 0  # how many times the doorbell was armed (a statement each, tests aside)
        self._conn: asyncpg.Connection | None = None
        self._pid = 0  # its backend: the disarm's own rings are not for us
        self._talk = anyio.Lock()  # one statement at a time on the connection
        self._armed = False  # the producer waits for a ring
        # The doorbell's locks this session holds (aioq.sql.doorbell): standby of these queues,
        # duty of these; and the queues whose duty a worker may not take yet: an insert is in
        # flight (see arm()).
        self._standby: frozenset[str] = frozenset()
        self._duty: frozenset[str] = frozenset()
        self._in_flight: frozenset[str] = frozenset()
        self._wake = anyio.Event()  # the connection was lost, or the doorbell must be disarmed
        self._lost = False

    name = "listener"
    backoff = Backoff(base=0.1, max=10.0, jitter=0.1)

    def _on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        if pid == self._pid:
            return  # the disarm rang the workers that slept on our watch: not a job for us
        if payload in self.queues:
            # The producer first: its claim goes out before the disarm (the pickup latency).
            self.ring()
            if self._armed:
                # One ring per sleep: inserts stop ringing once the locks are released.
                self._armed = False
                self._wake.set()
        elif payload == LIMITS_CHANGED and self.on_limits is not None:
            self.on_limits()

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
        conn = self._conn
        if conn is None or (self._armed and not self._in_flight and wanted == self._standby):
            return Armed.SLEEP
        try:
            # Under the lock: a disarm in flight finishes first, and we then see it.
            async with self._talk:
                if self._conn is not conn:
                    return Armed.SLEEP  # lost meanwhile
                dropped = self._standby - wanted
                if dropped:
                    await sql.DISARM_DOORBELL.run(
                        conn,
                        self.schema,
                        sorted(dropped),
                        sorted(self._duty & dropped),
                        within=self.keepalive,
                    )
                    self._standby -= dropped
                    self._duty -= dropped
                    self._in_flight -= dropped
                fresh = wanted - self._standby
                tried = fresh | self._in_flight
                if not tried:
                    # Never released since the last arm: every insert since has rung.
                    self._armed = True
                    return Armed.SLEEP
                found = await sql.ARM_DOORBELL.rows(
                    conn, self.schema, sorted(fresh), sorted(tried), within=self.keepalive
                )
                if self._conn is not conn:
                    return Armed.SLEEP  # lost meanwhile, and the locks with it
                if fresh:
                    self.arms += 1
                self._standby |= fresh
                self._duty |= {d.queue for d in found if d.duty}
                self._in_flight = frozenset(d.queue for d in found if not d.covered)
                self._armed = True
                in_flight = bool(self._in_flight)
        except Exception as exc:
            # The connection is going: run_once notices and reconnects; polling covers it.
            logger.debug("arming the doorbell failed: %s: %s", type(exc).__name__, exc)
            return Armed.SLEEP
        return Armed.LOOK_AGAIN if in_flight else Armed.LOOK

    async def _disarm(self, conn: asyncpg.Connection) -> None:
        """Leave duty and standby on every queue (ringing those that slept on our watch)."""
        await sql.DISARM_DOORBELL.run(
            conn, self.schema, sorted(self._standby), sorted(self._duty), within=self.keepalive
        )
        self._standby = self._duty = self._in_flight = frozenset()

    def _on_lost(self, conn: object) -> None:
        self._lost = True
        self._wake.set()

    async def run_once(self) -> None:
        """One LISTEN session: connect, LISTEN, return once the connection is lost or stops
        answering (the next session starts after :meth:`interval`; a failed connect raises
        and is retried with backoff)."""
        conn: asyncpg.Connection = await self.connect()
        try:
            self._lost = False
            conn.add_termination_listener(self._on_lost)
            await conn.add_listener(self.channel, self._on_notify)
            for channel, handler in self.control.items():
                await conn.add_listener(channel, _payload_to(handler))
            self.connections += 1
            self.failures.reset()  # the backoff starts afresh after a good connection
            self.connected.set()
            self._pid = conn.get_server_pid()
            self._conn = conn
            self.ring()  # anything deferred while we were away is found now
            logger.debug("listening on %s", self.channel)
            while not self._lost:
                with anyio.move_on_after(self.keepalive) as idle:
                    await self._wake.wait()
                self._wake = anyio.Event()
                if self._lost:
                    break
                async with self._talk:
                    if self._standby and not self._armed:
                        # Woken by a ring: further inserts need not ring until we sleep again.
                        await self._disarm(conn)
                    elif idle.cancelled_caught:
                        # A cut network shows no termination: ask the server.
                        await PING.run(conn, self.schema, within=self.keepalive)
            logger.warning("LISTEN connection lost; reconnecting in %.2fs", self.interval())
        finally:
            self._conn = None
            on_duty = bool(self._duty) and not self._lost
            self._armed = False
            self.connected = anyio.Event()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                try:
                    if on_duty:
                        # Workers that slept on our watch are rung; the locks go with the
                        # session anyway (a worker that dies leaves them to their polls).
                        async with self._talk:
                            await self._disarm(conn)
                    await conn.close(timeout=1)
                except Exception:
                    conn.terminate()
            self._standby = self._duty = self._in_flight = frozenset()

    def interval(self) -> float:
        """Seconds before reconnecting after a session ended: the backoff's first step."""
        return self.backoff.base

    def log_failure(self, exc: Exception, delay: float) -> None:
        """One warning line: polling goes on meanwhile."""
        logger.warning(
            "LISTEN connection failed (%s: %s); polling meanwhile, retrying in %.2fs",
            type(exc).__name__,
            exc,
            delay,
        )


def _payload_to(handler: Callable[[str], None]) -> Callable[[object, int, str, object], None]:
    def on_notify(conn: object, pid: int, channel: str, payload: object) -> None:
        handler(str(payload))

    return on_notify
