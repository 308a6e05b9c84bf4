"""The worker's one LISTEN connection: a doorbell per served queue, reconnected with backoff."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import anyio
import asyncpg

from aioq.backoff import Backoff
from aioq.service import Service
from aioq.sql import LIMITS_CHANGED, channel_name
from aioq.sql import doorbell as sql
from aioq.sql.admin import PING

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
        self._talk = anyio.Lock()  # one statement at a time on the connection
        self._armed = False  # the producer waits for a ring
        self._held = False  # the session holds the doorbell's locks (see arm())
        self._in_flight = False  # the last test found an insert in flight (see arm())
        self._wake = anyio.Event()  # the connection was lost, or the doorbell must be disarmed
        self._lost = False

    name = "listener"
    backoff = Backoff(base=0.1, max=10.0, jitter=0.1)

    def _on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        if payload in self.queues:
            # The producer first: its claim goes out before the disarm (the pickup latency).
            self.ring()
            if self._armed:
                # One ring per sleep: inserts stop ringing once the locks are released.
                self._armed = False
                self._wake.set()
        elif payload == LIMITS_CHANGED and self.on_limits is not None:
            self.on_limits()

    async def arm(self) -> Armed:
        """Make inserts into our queues ring, before the producer sleeps ("The doorbell").

        An insert that ran before the doorbell was armed did not ring: the producer must look
        for it once more (LOOK) before it sleeps; if such an insert was still in flight (its
        transaction open, its row invisible to that look), again once it may have committed
        (LOOK_AGAIN: the next arm() tests it again). SLEEP when every insert since the last
        look rings, or none can (no connection: polling covers it).
        """
        conn = self._conn
        if conn is None or (self._armed and not self._in_flight):
            return Armed.SLEEP
        try:
            # Under the lock: a disarm in flight finishes first, and we then see it.
            async with self._talk:
                if self._conn is not conn:
                    return Armed.SLEEP  # lost meanwhile
                if self._held and not self._in_flight:
                    # Never released since the last arm: every insert since has rung.
                    self._armed = True
                    return Armed.SLEEP
                test = sql.INSERTS_IN_FLIGHT if self._held else sql.ARM_DOORBELL
                in_flight = bool(
                    await test.row(conn, self.schema, self.queues_list, within=self.keepalive)
                )
                if self._conn is not conn:
                    return Armed.SLEEP  # lost meanwhile, and the locks with it
                if not self._held:
                    self.arms += 1
                self._armed = self._held = True
                self._in_flight = in_flight
        except Exception as exc:
            # The connection is going: run_once notices and reconnects; polling covers it.
            logger.debug("arming the doorbell failed: %s: %s", type(exc).__name__, exc)
            return Armed.SLEEP
        return Armed.LOOK_AGAIN if in_flight else Armed.LOOK

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
                    if self._held and not self._armed:
                        # Woken by a ring: further inserts need not ring until we sleep again.
                        await sql.DISARM_DOORBELL.run(
                            conn, self.schema, self.queues_list, within=self.keepalive
                        )
                        self._held = self._in_flight = False
                    elif idle.cancelled_caught:
                        # A cut network shows no termination: ask the server.
                        await PING.run(conn, self.schema, within=self.keepalive)
            logger.warning("LISTEN connection lost; reconnecting in %.2fs", self.interval())
        finally:
            self._conn = None
            self._armed = self._held = self._in_flight = False  # the locks went with the session
            self.connected = anyio.Event()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                try:
                    await conn.close(timeout=1)
                except Exception:
                    conn.terminate()

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
