"""One live worker per worker id: the hold a worker given its id keeps on it for its whole run.

docs/architecture.md, "Worker ids". Two live workers with one id would release each other's
running jobs (a worker releases every row under its id at start and at its end): the second
one must not start. A worker given its id takes a session advisory lock on it
(:mod:`aioq.sql.identity`) on a direct connection of its own, before anything else of its run,
and holds it until the run's last release is written; the connection closes with the process,
so a killed worker's id comes free as soon as the server sees its connection gone (at once for
a killed process; within the keepalives below for a vanished host). A worker whose id is held
waits :data:`WORKER_ID_WAIT` for it (a predecessor killed a moment ago), then refuses to start.
A generated id (host, pid, random) is unique by construction: it takes no lock and no
connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio
import asyncpg

from aioq.db import Connection
from aioq.errors import WorkerIdInUse
from aioq.sql.identity import HOLDS_WORKER_ID, TAKE_WORKER_ID, WORKER_ID_HOLDER, Holder
from aioq.worker.service import Service

__all__ = ("KEEPALIVES", "WORKER_ID_WAIT", "IdHold")

logger = logging.getLogger(__name__)

WORKER_ID_WAIT = 5.0
"""How long a starting worker waits for its id held by another session: a predecessor killed a
moment ago (SIGKILL) ends its session as soon as the server reads the closed socket, well
within this."""
TAKE_EVERY = 0.1  # how often a starting worker tries its held id again meanwhile
KEEPALIVES = {
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
}
"""The hold's session settings: the server probes an idle hold's client after 10 s and drops it
after 3 probes 5 s apart, so the id of a worker whose host vanished (no FIN, no reset) comes
free within about 25 s, not the system's default two hours."""

Release = Callable[[], Awaitable[None]]
Connect = Callable[[], Awaitable[tuple[Connection, Release]]]
_LOST = (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError, TimeoutError)


class IdHold(Service[bool]):
    """The worker's hold on its id: taken before the run, checked every ``interval`` seconds,
    taken again on a new connection if its connection was lost. If another worker took the id
    meanwhile, ``on_lost`` is called once (the run stops, releasing only its own claims)."""

    name = "id hold"

    def __init__(
        self,
        *,
        schema: str,
        worker_id: str,
        connect: Connect,
        interval: float,
        wait: float = WORKER_ID_WAIT,
    ) -> None:
        super().__init__()
        self.schema = schema
        self.worker_id = worker_id
        self.connect = connect
        self.every = interval
        self.wait_for_id = wait
        self.lost = False  # another live worker took the id while our hold's connection was down
        self.on_lost: Callable[[], None] = lambda: None  # set by the run that serves with it
        self._conn: Connection | None = None
        self._release: Release | None = None
        self._pid: int | None = None  # the server process of the session that holds the id

    async def take(self) -> None:
        """Connect and take the id, waiting for it up to ``wait`` seconds; else raise
        :class:`aioq.errors.WorkerIdInUse` naming who holds it. Nothing else of the run has
        started yet: a refused worker has claimed and released nothing."""
        conn, release = await self.connect()
        try:
            deadline = time.monotonic() + self.wait_for_id
            while not await TAKE_WORKER_ID.row(conn, self.schema, self.worker_id):
                if time.monotonic() >= deadline:
                    holder = await WORKER_ID_HOLDER.row(conn, self.schema, self.worker_id)
                    raise WorkerIdInUse(self.worker_id, _refusal(self.worker_id, holder))
                await anyio.sleep(TAKE_EVERY)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await release()
            raise
        self._conn, self._release, self._pid = conn, release, conn.get_server_pid()

    async def run_once(self) -> bool:
        """Check the hold; after a lost connection, take the id again on a new one. Return
        whether the worker holds its id."""
        if self.lost:
            return False
        conn = self._conn
        if conn is not None and not conn.is_closed():
            try:
                if await HOLDS_WORKER_ID.row(conn, self.schema, self.worker_id):
                    return True
            except _LOST:
                pass
            await self.close()  # gone, or (never seen) the lock with it: a new session
        conn, release = await self.connect()
        try:
            taken = await TAKE_WORKER_ID.row(conn, self.schema, self.worker_id)
            holder = (
                None if taken else await WORKER_ID_HOLDER.row(conn, self.schema, self.worker_id)
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await release()
            raise
        if not taken and (holder is None or holder.pid == self._pid):
            # Our own old session still holds it (the server has not seen it gone yet: its
            # keepalives end it), or it was just let go: try again, not lost.
            with anyio.CancelScope(shield=True):
                await release()
            raise ConnectionError(f"worker {self.worker_id}: its old session still holds its id")
        if taken:
            self._conn, self._release, self._pid = conn, release, conn.get_server_pid()
            logger.warning(
                "worker %s: its id's connection was lost; it holds its id again", self.worker_id
            )
            return True
        with anyio.CancelScope(shield=True):
            await release()
        self.lost = True
        logger.error(
            "worker %s: its id's connection was lost and another live worker has taken the id"
            " since; this worker stops, releasing only the claims it holds",
            self.worker_id,
        )
        self.on_lost()
        return False

    def log_failure(self, exc: Exception, delay: float) -> None:
        """A check or a new hold that failed: said, and tried again after ``delay``."""
        logger.warning(
            "worker %s: cannot check or take its id (%s: %s); trying again in %.2fs",
            self.worker_id,
            type(exc).__name__,
            exc,
            delay,
        )

    def interval(self) -> float:
        """The check's period (the worker's heartbeat interval)."""
        return self.every

    def stopped(self) -> bool:
        """Once the id is lost, nothing is left to hold."""
        return self.lost

    async def close(self) -> None:
        """Let go of the id: its connection closes (the session's locks go with it)."""
        release, self._release, self._conn = self._release, None, None
        if release is not None:
            with anyio.CancelScope(shield=True):
                await release()


def _refusal(worker_id: str, holder: Holder | None) -> str:
    """The one line a refused worker says."""
    where = ""
    if holder is not None and (holder.address or holder.since):
        frm = f" from {holder.address}" if holder.address else ""
        since = f" since {holder.since:%Y-%m-%d %H:%M:%S%z}" if holder.since else ""
        where = f" (its connection{frm}{since})"
    return (
        f"worker id {worker_id!r} is held by a live worker{where}: two workers with one id"
        " would release each other's running jobs. Give each worker its own id, or stop the"
        " other one first (a killed worker's id comes free once the server sees its connection"
        " gone: at once, or within about 25 s for a vanished host)"
    )
