"""Await a job's result: :func:`result` (``aioq.result``) and ``Task.result``.

A task registered with ``result_ttl`` keeps its return value (JSON) in the ``results`` table
for that many seconds; its completion, death or cancel also rings the schema's results channel
with the job id. A waiter LISTENs on that channel and reads the job's state when rung, and
polls as the guarantee (a missed notification, a LISTEN that PgBouncer cannot hold), with a
delay that grows to a few seconds. All waiters of one process on one pool (or connection)
share one LISTEN connection: the first one borrows it from the pool and the last one gives it
back. A waiter holds no other connection while it waits; each poll borrows one for a statement.

The LISTEN never takes the application's last connection: it is borrowed only while the pool
has a connection to spare beyond it (counting the application's, not the waiters' own short
reads), and given back as soon as a waiter sees that the application needs it; meanwhile the
waiters poll. Every wait (for a connection, for the LISTEN's set-up, for a read) is bounded by
the waiter's timeout.

A SQLAlchemy session (or connection) is never waited on: its transaction (which reading on it
would begin) would hold a snapshot and locks for the whole wait, and a LISTEN in a transaction
only takes effect at its commit, so every wait would be a poll. The waiters of one engine share
one connection of the engine's pool instead, outside any transaction, for their LISTEN and
their polls (:data:`aioq.db.WAIT_ADAPTERS`); it goes back to the pool with the last of them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Hashable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import asyncpg

from aioq.codec import decode_result
from aioq.db import Executor, Opener, Target, executor, wait_opener
from aioq.dbapi import SyncTarget
from aioq.dbapi import executor as sync_executor
from aioq.errors import (
    UNCOMMITTED,
    ConfigError,
    JobCancelled,
    JobFailed,
    ResultMissing,
    ResultTimeout,
)
from aioq.job import possible_id
from aioq.sql import DEFAULT_SCHEMA, results_channel
from aioq.sql.control import RESULT_STATE, ResultState

__all__ = ("DEFAULT_RESULT_TIMEOUT", "result", "result_sync")

logger = logging.getLogger(__name__)

DEFAULT_RESULT_TIMEOUT = 30.0
_FIRST_POLL = 0.25  # then doubling, up to:
_MAX_POLL = 5.0  # while the LISTEN works (a notification is the fast path)
_MAX_POLL_DEAF = 1.0  # while it does not, or while the application may soon need its connection
_RELISTEN_AFTER = 1.0  # seconds between attempts to set the LISTEN up again
_READ_FLOOR = 1.0  # a read's statement may take this long even when less time remains
_CONNECT_FLOOR = 0.001  # a waiter out of time still takes a connection that is free at once
_DROP_WITHIN = 2.0  # seconds to UNLISTEN and give the connection back; then it is closed
_FIRST_POLL_SYNC = 0.05  # result_sync: then doubling, up to:
_MAX_POLL_SYNC = 1.0


class _Hub:
    """One LISTEN on the results channel for every waiter of one pool or connection."""

    def __init__(self, db: Executor | None, channel: str, opener: Opener | None = None) -> None:
        self.db: Any = db  # None until open() when the connection comes from an opener
        self.opener = opener
        self._stack = AsyncExitStack()
        self.channel = channel
        self.waiters: dict[int, set[anyio.Event]] = {}
        self.count = 0
        self.conn: Any = None  # the listening connection (asyncpg's, or a pool's proxy)
        self.borrowed = False  # conn came from the pool and goes back to it
        self.retry_at = 0.0
        self.listens = 0  # how many times a LISTEN was set up (for tests and debugging)
        self.reads = 0  # the waiters' reads holding a pool connection now
        self._lock = anyio.Lock()
        # A plain connection runs one statement at a time: its waiters take turns.
        self._turn = anyio.Lock() if not isinstance(db, asyncpg.Pool) else None

    def add(self, job_id: int, event: anyio.Event) -> None:
        self.waiters.setdefault(job_id, set()).add(event)

    def discard(self, job_id: int, event: anyio.Event) -> None:
        events = self.waiters.get(job_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self.waiters[job_id]

    async def open(self) -> None:
        """Take the connection to wait on from the opener, once (no-op without one)."""
        if self.opener is None or self.db is not None:
            return
        async with self._lock:
            if self.db is None:
                self.db = await self._stack.enter_async_context(self.opener())

    @property
    def listening(self) -> bool:
        return self.conn is not None and not self.conn.is_closed()

    def spare(self) -> int:
        """Connections the pool could still lend the application beyond the LISTEN's own.

        The application's are those in use that are neither the LISTEN nor a waiter's read
        (a read gives its connection back within a statement). A plain connection: no limit.
        """
        pool = self.db
        if not isinstance(pool, asyncpg.Pool):
            return 1 << 30
        in_use = pool.get_size() - pool.get_idle_size()
        ours = self.reads + (1 if self.borrowed else 0)
        return pool.get_max_size() - max(0, in_use - ours) - 1

    def _on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        try:
            job_id = int(str(payload))
        except ValueError:
            return
        for event in self.waiters.get(job_id, ()):
            event.set()

    async def ensure_listening(self, deadline: float) -> None:
        """Set the LISTEN up if it is not and the pool can spare it, giving up at ``deadline``.

        At most once a second while it keeps failing; given back when the application needs
        the connection (a pool that can spare none beyond it).
        """
        if self.listening and self.borrowed and self.spare() < 1:
            # The application's turn: poll until the pool can spare one again.
            with anyio.move_on_after(deadline - anyio.current_time()):
                async with self._lock:
                    if self.listening and self.borrowed and self.spare() < 1:
                        logger.debug("results LISTEN gives its connection back")
                        self.retry_at = anyio.current_time() + _RELISTEN_AFTER
                        with anyio.CancelScope(shield=True):
                            await self._drop()
            return
        if self.listening or anyio.current_time() < self.retry_at or self.spare() < 1:
            return
        with anyio.move_on_after(deadline - anyio.current_time()):
            async with self._lock:
                if self.listening or self.spare() < 1:
                    return
                await self._drop()
                try:
                    if isinstance(self.db, asyncpg.Pool):
                        self.conn, self.borrowed = await self.db.acquire(), True
                        await self.conn.add_listener(self.channel, self._on_notify)
                    else:
                        self.conn = self.db
                        async with self._turn or _NO_LOCK:
                            await self.conn.add_listener(self.channel, self._on_notify)
                    self.listens += 1
                except Exception as exc:  # polling goes on; try again later
                    logger.debug("results LISTEN failed (%s); polling", exc)
                    self.retry_at = anyio.current_time() + _RELISTEN_AFTER
                    await self._drop()
                except BaseException:  # out of time: leave no half-made LISTEN behind
                    self.retry_at = anyio.current_time() + _RELISTEN_AFTER
                    with anyio.CancelScope(shield=True):
                        await self._drop()
                    raise

    async def query(self, schema: str, job_id: int, deadline: float) -> ResultState | None:
        """Read the job's state; raise TimeoutError if no connection came free by ``deadline``."""
        budget = max(deadline - anyio.current_time(), _CONNECT_FLOOR)
        within = max(deadline - anyio.current_time(), _READ_FLOOR)
        if isinstance(self.db, asyncpg.Pool):
            conn = None
            with anyio.move_on_after(budget):
                conn = await self.db.acquire()
            if conn is None:
                raise TimeoutError
            self.reads += 1  # holding one: not the application's
            try:
                return await RESULT_STATE.row(conn, schema, job_id, within=within)
            finally:
                with anyio.CancelScope(shield=True):
                    await self.db.release(conn)
                self.reads -= 1
        turn = self._turn or _NO_LOCK
        got = False
        with anyio.move_on_after(budget):
            await turn.__aenter__()
            got = True
        if not got:
            raise TimeoutError
        try:
            return await RESULT_STATE.row(self.db, schema, job_id, within=within)
        finally:
            await turn.__aexit__(None, None, None)

    async def close(self) -> None:
        async with self._lock:
            try:
                await self._drop()
            finally:
                if self.opener is not None:
                    self.db = None
                    await self._stack.aclose()  # the opener's connection goes back

    async def _drop(self) -> None:
        conn, borrowed, self.conn, self.borrowed = self.conn, self.borrowed, None, False
        if conn is None:
            return
        try:
            # Bounded: the last waiter gives the LISTEN back after its own wait ended.
            with anyio.move_on_after(_DROP_WITHIN) as late:
                if not conn.is_closed():
                    async with self._turn or _NO_LOCK:
                        await conn.remove_listener(self.channel, self._on_notify)
            if late.cancelled_caught and borrowed:
                conn.terminate()  # the pool's: it makes a new one when needed
        except Exception as exc:
            logger.debug("results UNLISTEN failed: %s", exc)
        finally:
            if borrowed:
                assert isinstance(self.db, asyncpg.Pool)
                await self.db.release(conn, timeout=_DROP_WITHIN)


class _NoLock:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NoLock()
_hubs: dict[tuple[Hashable, str], _Hub] = {}


def listening_connections() -> int:
    """How many LISTEN connections this process's waiters hold now (one per pool in use)."""
    return sum(1 for hub in _hubs.values() if hub.listening)


async def result(
    db: Target,
    job_id: int,
    *,
    timeout: float | None = DEFAULT_RESULT_TIMEOUT,  # noqa: ASYNC109 (the API contract)
    schema: str = DEFAULT_SCHEMA,
) -> Any:
    """Wait for a job to end and return its task's return value (decoded JSON).

    Raises :class:`JobFailed` (dead), :class:`JobCancelled`, :class:`ResultMissing` (no
    result stored: expired, a task without ``result_ttl``, or no such job), and
    :class:`ResultTimeout` (a ``TimeoutError``) when the job is still pending or running
    after ``timeout`` seconds (None: wait for ever), or no connection came free to read it;
    the job itself is left alone.
    """
    if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
        raise ConfigError("timeout", f"must be None or a number of seconds >= 0, got {timeout!r}")
    if not possible_id(job_id):
        judge_result(job_id, None)  # no job has it: ResultMissing
    channel = results_channel(schema)
    deadline = math.inf if timeout is None else anyio.current_time() + timeout
    key, executor_, opener = await _wait_on(db)
    hub = _hubs.get((key, channel))
    if hub is None:
        hub = _hubs[key, channel] = _Hub(executor_, channel, opener)
    hub.count += 1
    event = anyio.Event()
    hub.add(job_id, event)
    status = "unknown"  # until a read tells
    try:
        with anyio.move_on_after(deadline - anyio.current_time()):
            await hub.open()
        if hub.db is None:  # no connection of the engine came free in time
            raise ResultTimeout(job_id, timeout or 0.0, status)
        delay = _FIRST_POLL
        warned = False
        while True:
            await hub.ensure_listening(deadline)  # before reading: a later ring is never missed
            try:
                row = await hub.query(schema, job_id, deadline)
            except TimeoutError:  # no connection came free in time (or the read was too slow)
                raise ResultTimeout(job_id, timeout or 0.0, status) from None
            if row is None and executor_ is None:  # waited outside the session's transaction
                await _missing_here(db, schema, job_id)
            status = judge_result(job_id, row) or ""
            assert row is not None  # judge_result raised otherwise
            if not status:
                return decode_result(row.result or "null")
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                raise ResultTimeout(job_id, timeout or 0.0, status, uncommitted=row.uncommitted)
            warned = warned or warn_uncommitted(job_id, row)
            with anyio.move_on_after(min(delay, remaining)):
                await event.wait()
            if event.is_set():
                hub.discard(job_id, event)
                event = anyio.Event()
                hub.add(job_id, event)
            else:
                # Deaf, or a pool one connection short of the application's need: look again
                # (and give the LISTEN back) within a second.
                deaf = not hub.listening or hub.spare() < 2
                delay = min(2 * delay, _MAX_POLL_DEAF if deaf else _MAX_POLL)
    finally:
        hub.discard(job_id, event)
        hub.count -= 1
        if hub.count == 0:
            del _hubs[key, channel]  # a waiter that comes now builds a new hub
            with anyio.CancelScope(shield=True):
                await hub.close()


def result_sync(
    db: SyncTarget,
    job_id: int,
    *,
    timeout: float | None = DEFAULT_RESULT_TIMEOUT,
    schema: str = DEFAULT_SCHEMA,
) -> Any:
    """Wait for a job to end and return its value, as :func:`aioq.result` does (it raises the
    same errors), from synchronous code.

    It polls the job's state, every 50 ms at first and at most every second: each poll is one
    short read. On a connection in a transaction, every poll runs in that transaction (at
    READ COMMITTED each sees the latest commits); outside one, each commits on its own.
    """
    if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
        raise ConfigError("timeout", f"must be None or a number of seconds >= 0, got {timeout!r}")
    run = sync_executor(db)
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    delay = _FIRST_POLL_SYNC
    warned = False
    while True:
        state = RESULT_STATE.row_sync(run, schema, job_id) if possible_id(job_id) else None
        status = judge_result(job_id, state)
        assert state is not None  # judge_result raised otherwise
        if status is None:
            return decode_result(state.result or "null")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ResultTimeout(job_id, timeout or 0.0, status, uncommitted=state.uncommitted)
        warned = warned or warn_uncommitted(job_id, state)
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, _MAX_POLL_SYNC)


async def _wait_on(db: Target) -> tuple[Hashable, Executor | None, Opener | None]:
    """What to wait on for ``db``: its key for the shared hub, and the asyncpg connection or
    pool, or the opener of a connection outside a session's transaction."""
    found = await wait_opener(db)
    if found is not None:
        return found[0], None, found[1]
    conn = await executor(db)  # an asyncpg connection or pool (or a session's, unwrapped)
    return id(conn), conn, None


async def _missing_here(db: Target, schema: str, job_id: int) -> None:
    """Raise ResultMissing saying why if the job, unseen outside the transaction of ``db`` (a
    SQLAlchemy session or connection), was deferred in that transaction and not committed."""
    in_transaction = getattr(db, "in_transaction", None)
    if not (callable(in_transaction) and in_transaction()):
        return  # no transaction open: the job is missing indeed (and none is begun here)
    row = await RESULT_STATE.row(await executor(db), schema, job_id)
    if row is not None and row.uncommitted:
        raise ResultMissing(job_id, UNCOMMITTED)


def warn_uncommitted(job_id: int, row: ResultState) -> bool:
    """Log once that the wait cannot end before its own transaction commits; True if logged."""
    if row.uncommitted:
        logger.warning("waiting for the result of job %d, but %s", job_id, UNCOMMITTED)
    return row.uncommitted


def judge_result(job_id: int, row: ResultState | None) -> str | None:
    """Return None when the row holds the result, the status to wait on, or raise."""
    if row is None:
        raise ResultMissing(
            job_id,
            "no result is stored (its task has no result_ttl, the result expired and was"
            " pruned, or no job has this id)",
        )
    status = row.status
    if status == "succeeded":
        if row.expired:
            raise ResultMissing(job_id, "its result expired")
        return None
    if status == "dead":
        raise JobFailed(job_id, row.last_error)
    if status == "cancelled":
        raise JobCancelled(job_id)
    return status
