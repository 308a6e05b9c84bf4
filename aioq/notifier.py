"""The worker's one LISTEN connection: a doorbell per served queue, reconnected with backoff."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import anyio
import asyncpg

from aioq._service import Service
from aioq.backoff import Backoff
from aioq.queries import LIMITS_CHANGED

__all__ = ("Listener",)

logger = logging.getLogger(__name__)


class _Lost(Exception):
    """The LISTEN connection ended (or stopped answering)."""


class Listener(Service):
    """LISTENs on the schema's channel and rings the doorbell for notifications of our queues.

    Notifications are only a hint: polling goes on while this connection is down, and the
    doorbell rings on every (re)connect so the producer polls at once.
    """

    def __init__(
        self,
        *,
        connect: Callable[[], Any],
        channel: str,
        queues: Collection[str],
        ring: Callable[[], None],
        keepalive: float = 5.0,
        control: Mapping[str, Callable[[str], None]] | None = None,
    ) -> None:
        super().__init__()
        self.connect = connect
        self.channel = channel
        self.queues = frozenset(queues)
        self.ring = ring
        self.keepalive = keepalive
        # jobcontrol: more channels on the same connection (the control channel), with the
        # handler each notification's payload goes to.
        self.control = dict(control or {})
        self.connected = anyio.Event()
        self.connections = 0  # how many times a LISTEN was established
        self.on_limits: Callable[[], None] | None = None  # aioq.set_queue changed a queue

    name = "listener"
    backoff = Backoff(base=0.1, max=10.0, jitter=0.1)

    def _on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        if payload in self.queues:
            self.ring()
        elif payload == LIMITS_CHANGED and self.on_limits is not None:
            self.on_limits()

    async def run_once(self) -> None:
        """Connect, LISTEN, and raise once the connection is lost or stops answering."""
        conn: asyncpg.Connection = await self.connect()
        try:
            lost = anyio.Event()
            conn.add_termination_listener(lambda _conn: lost.set())
            await conn.add_listener(self.channel, self._on_notify)
            for channel, handler in self.control.items():
                await conn.add_listener(channel, _payload_to(handler))
            self.connections += 1
            self.failures.reset()  # the backoff starts afresh after a good connection
            self.connected.set()
            self.ring()  # anything deferred while we were away is found now
            logger.debug("listening on %s", self.channel)
            while not lost.is_set():
                with anyio.move_on_after(self.keepalive):
                    await lost.wait()
                if not lost.is_set():
                    # A cut network shows no termination: ask the server.
                    await conn.execute("SELECT 1", timeout=self.keepalive)
            raise _Lost
        finally:
            self.connected = anyio.Event()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                try:
                    await conn.close(timeout=1)
                except Exception:
                    conn.terminate()

    def interval(self) -> float:
        """Never used: every session ends in a failure, retried with backoff."""
        return 0.0

    def log_failure(self, exc: Exception, delay: float) -> None:
        """One warning line: polling goes on meanwhile."""
        if isinstance(exc, _Lost):
            logger.warning("LISTEN connection lost; reconnecting in %.2fs", delay)
        else:
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
