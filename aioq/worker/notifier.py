"""The worker's one LISTEN connection: a doorbell per served queue, reconnected with backoff.

The doorbell's locks on this session, their arming and disarming, are :class:`aioq.doorbell.Watch`;
this service owns the session: it connects, LISTENs, rings the worker's doorbell for a
notification of its queues, checks the connection, and reconnects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import anyio
import asyncpg

from aioq.backoff import Backoff
from aioq.doorbell import Armed, Watch
from aioq.sql import LIMITS_CHANGED, channel_name
from aioq.sql.admin import PING
from aioq.worker.service import Service

__all__ = ("Listener",)

logger = logging.getLogger(__name__)


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
        self.on_limits = on_limits  # aioq.admin.set_queue changed a queue's limits
        self.watch = Watch(schema=schema, queues=queues, within=keepalive)
        self._pid = 0  # its backend: the disarm's own rings are not for us
        self._wake = anyio.Event()  # the connection was lost, or the doorbell must be disarmed
        self._lost = False

    name = "listener"
    backoff = Backoff(base=0.1, max=10.0, jitter=0.1)

    def _on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        if payload == LIMITS_CHANGED:
            if self.on_limits is not None:
                self.on_limits()
            return
        queue = str(payload)
        mine = queue in self.queues
        if mine:
            # The producer first: its claim goes out before the disarm (the pickup latency).
            self.ring()
        if self.watch.rung(queue):
            if not mine:
                # The wildcard rang for another queue: it is disarmed, and the producer arms
                # it again after a pause (Watch.rung).
                self.ring()
            self._wake.set()

    def _on_handover(self, conn: object, pid: int, channel: str, payload: object) -> None:
        if pid == self._pid:
            return  # our own disarm rang the workers that slept on our watch
        try:
            key = int(str(payload))
        except ValueError:
            return
        if self.watch.handed(key):
            # We slept on the watch of a worker that left duty: look, and arm again.
            self.ring()
            self._wake.set()

    @property
    def arms(self) -> int:
        """How many times the doorbell was armed on this worker's sessions."""
        return self.watch.arms

    async def arm(self, queues: Iterable[str] | None = None) -> Armed:
        """Arm the doorbell before the producer sleeps (:meth:`aioq.doorbell.Watch.arm`)."""
        return await self.watch.arm(queues)

    def later(self) -> float:
        """Seconds before the wildcard may be armed again (:data:`Armed.LATER`)."""
        return self.watch.later()

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
            await conn.add_listener(self.watch.handover, self._on_handover)
            for channel, handler in self.control.items():
                await conn.add_listener(channel, _payload_to(handler))
            self.connections += 1
            self.failures.reset()  # the backoff starts afresh after a good connection
            self.connected.set()
            self._pid = conn.get_server_pid()
            self.watch.begin(conn)
            self.ring()  # anything deferred while we were away is found now
            logger.debug("listening on %s", self.channel)
            while not self._lost:
                with anyio.move_on_after(self.keepalive) as idle:
                    await self._wake.wait()
                self._wake = anyio.Event()
                if self._lost:
                    break
                async with self.watch.talk:
                    if self.watch.resting:
                        # Woken by a ring: further inserts need not ring until we sleep again.
                        await self.watch.disarm(conn)
                    elif idle.cancelled_caught:
                        # A cut network shows no termination: ask the server.
                        await PING.run(conn, self.schema, within=self.keepalive)
            logger.warning("LISTEN connection lost; reconnecting in %.2fs", self.interval())
        finally:
            on_duty = self.watch.end() and not self._lost
            self.connected = anyio.Event()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                try:
                    if on_duty:
                        # Workers that slept on our watch are rung; the locks go with the
                        # session anyway (a worker that dies leaves them to their polls).
                        async with self.watch.talk:
                            await self.watch.disarm(conn)
                    await conn.close(timeout=1)
                except Exception:
                    conn.terminate()
            self.watch.forget()

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
