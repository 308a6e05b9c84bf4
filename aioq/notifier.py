"""The worker's one LISTEN connection: a doorbell per served queue, reconnected with backoff."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskStatus

from aioq._service import StepBackoff

__all__ = ("Listener",)

logger = logging.getLogger(__name__)


class Listener:
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

    def _on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        if payload in self.queues:
            self.ring()

    async def run_once(self) -> None:
        """Connect, LISTEN, and return when the connection is lost or stops answering."""
        conn: asyncpg.Connection = await self.connect()
        try:
            lost = anyio.Event()
            conn.add_termination_listener(lambda _conn: lost.set())
            await conn.add_listener(self.channel, self._on_notify)
            for channel, handler in self.control.items():
                await conn.add_listener(channel, _payload_to(handler))
            self.connections += 1
            self.connected.set()
            self.ring()  # anything deferred while we were away is found now
            logger.debug("listening on %s", self.channel)
            while not lost.is_set():
                with anyio.move_on_after(self.keepalive):
                    await lost.wait()
                if not lost.is_set():
                    # A cut network shows no termination: ask the server.
                    await conn.execute("SELECT 1", timeout=self.keepalive)
        finally:
            self.connected = anyio.Event()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                try:
                    await conn.close(timeout=1)
                except Exception:
                    conn.terminate()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled, reconnecting with backoff."""
        task_status.started()
        backoff = StepBackoff(first=0.1, cap=10.0)
        while True:
            try:
                await self.run_once()
                backoff.reset()
                delay = backoff.next()
                logger.warning("LISTEN connection lost; reconnecting in %.2fs", delay)
            except Exception as exc:
                delay = backoff.next()
                logger.warning(
                    "LISTEN connection failed (%s: %s); polling meanwhile, retrying in %.2fs",
                    type(exc).__name__,
                    exc,
                    delay,
                )
            await anyio.sleep(delay)


def _payload_to(handler: Callable[[str], None]) -> Callable[[object, int, str, object], None]:
    def on_notify(conn: object, pid: int, channel: str, payload: object) -> None:
        handler(str(payload))

    return on_notify
