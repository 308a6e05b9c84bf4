"""The LISTEN connection (``aioq.worker.notifier.Listener``) on its own against a real PostgreSQL:
which notifications ring the doorbell, reconnecting after its backend is killed, and ringing at
once on every (re)connect so the producer polls (a whole worker's reconnect: test_lease.py;
when inserts ring at all, the armed doorbell across workers: test_doorbell.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import asyncpg
import pytest

import aioq
import aioq.doorbell
from aioq.doorbell import Armed, Watch
from aioq.sql import LIMITS_CHANGED, channel_name, control_channel
from aioq.worker.notifier import Listener

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0


class Bell:
    """Records each ring of the doorbell (and each other callback) in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.read = 0
        self._changed = anyio.Event()

    def callback(self, name: str) -> Callable[..., None]:
        def record(*args: object) -> None:
            self.seen.append(":".join([name, *map(str, args)]))
            self._changed.set()

        return record

    async def next(self) -> str:
        """The next callback not read yet (waiting for it, within the hang guard)."""
        with anyio.fail_after(HANG_GUARD):
            while self.read == len(self.seen):
                self._changed = anyio.Event()
                await self._changed.wait()
        self.read += 1
        return self.seen[self.read - 1]

    def pending(self) -> list[str]:
        """Every callback not read yet."""
        rest = self.seen[self.read :]
        self.read = len(self.seen)
        return rest


class Connections:
    """The listener's ``connect``: real connections, each one's backend pid kept; the first
    ``fail`` attempts are refused as an unreachable server would refuse them."""

    def __init__(self, dsn: str, fail: int = 0) -> None:
        self.dsn = dsn
        self.fail = fail
        self.pids: list[int] = []

    async def __call__(self) -> asyncpg.Connection:
        if self.fail:
            self.fail -= 1
            raise ConnectionRefusedError("refused (injected)")
        conn = await asyncpg.connect(self.dsn)
        self.pids.append(conn.get_server_pid())
        return conn


@asynccontextmanager
async def listening(listener: Listener) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        await tg.start(listener.run)
        yield
        tg.cancel_scope.cancel()


def listener_for(connect: Connections, bell: Bell) -> Listener:
    listener = Listener(
        connect=connect,
        queues={"default", "mail"},
        ring=bell.callback("ring"),
        schema="aioq",
        control={control_channel("aioq"): bell.callback("control")},
        on_limits=bell.callback("limits"),
    )
    return listener


async def test_a_defer_to_a_served_queue_rings_the_doorbell_and_others_do_not(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def work() -> None: ...

    bell = Bell()
    listener = listener_for(Connections(dsn), bell)
    async with listening(listener):
        assert await bell.next() == "ring"  # on connect: the producer polls at once
        assert listener.connected.is_set()
        # The producer is about to sleep: inserts ring now.
        assert await listener.arm() is Armed.LOOK
        await work.options(queue="elsewhere").defer(conn)  # nobody here serves it
        await work.options(queue="mail").defer(conn)
        assert await bell.next() == "ring"
        await conn.execute("SELECT pg_notify($1, $2)", control_channel("aioq"), "42")
        assert await bell.next() == "control:42"
        await conn.execute("SELECT pg_notify($1, $2)", channel_name("aioq"), LIMITS_CHANGED)
        assert await bell.next() == "limits"
        # The ring disarmed it: the producer arms it before sleeping again.
        assert await listener.arm() is Armed.LOOK
        await work.defer(conn)
        assert await bell.next() == "ring"
        assert bell.pending() == []  # the other queue's defer rang nothing
    assert listener.connections == 1


async def test_after_its_backend_is_killed_it_reconnects_rings_at_once_and_listens_again(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @registry.task
    async def work() -> None: ...

    bell = Bell()
    connections = Connections(dsn)
    listener = listener_for(connections, bell)
    with caplog.at_level(logging.WARNING, logger="aioq"):
        async with listening(listener):
            assert await bell.next() == "ring"
            [first] = connections.pids
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", first)
            # Whatever was deferred while it was away is found by the poll this ring starts.
            assert await bell.next() == "ring"
            assert listener.connections == 2
            [_, second] = connections.pids
            assert second != first
            assert await listener.arm() is Armed.LOOK  # a new session: the locks are taken afresh
            await work.defer(conn)
            assert await bell.next() == "ring"
    assert "LISTEN connection lost; reconnecting" in caplog.text
    assert bell.pending() == []


async def test_a_failed_connect_is_retried_with_backoff_and_rings_once_connected(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, caplog: pytest.LogCaptureFixture
) -> None:
    @registry.task
    async def work() -> None: ...

    bell = Bell()
    listener = listener_for(Connections(dsn, fail=2), bell)
    with caplog.at_level(logging.WARNING, logger="aioq"):
        async with listening(listener):
            assert await bell.next() == "ring"  # only once a connection is up
            assert listener.connections == 1
            assert listener.failures.count == 0  # a good connection resets the backoff
            assert await listener.arm() is Armed.LOOK
            await work.defer(conn)
            assert await bell.next() == "ring"
    failed = [r for r in caplog.records if "LISTEN connection failed" in r.getMessage()]
    assert len(failed) == 2
    assert "ConnectionRefusedError: refused (injected)" in failed[0].getMessage()


@pytest.mark.parametrize("wildcard", [False, True], ids=["one by one", "wildcard"])
async def test_an_insert_in_flight_while_it_arms_is_looked_for_until_it_ends(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    monkeypatch: pytest.MonkeyPatch,
    wildcard: bool,
) -> None:
    """The doorbell without a lost wake-up: an insert that ran before the doorbell was armed
    did not ring; while its transaction is open, arm() asks the producer to look again. Armed
    on the wildcard, the queues' keys are probed for it."""
    if wildcard:
        monkeypatch.setattr(aioq.doorbell, "MAX_ARMED", 0)

    @registry.task
    async def work() -> None: ...

    bell = Bell()
    listener = listener_for(Connections(dsn), bell)
    inserters = [await asyncpg.connect(dsn) for _ in range(2)]
    try:
        async with listening(listener):
            assert await bell.next() == "ring"
            open_txs = []
            for inserter, queue in zip(inserters, ["default", "mail"], strict=True):
                tx = inserter.transaction()
                await tx.start()
                await work.options(queue=queue).defer(inserter)  # nobody armed: no ring
                open_txs.append(tx)
            await work.options(queue="elsewhere").defer(conn)  # not served: never in flight
            assert await listener.arm() is Armed.LOOK_AGAIN
            assert listener.arms == 1
            assert await listener.arm() is Armed.LOOK_AGAIN  # tested again, not re-armed
            await open_txs[0].commit()
            assert await listener.arm() is Armed.LOOK_AGAIN  # "mail" is still in flight
            # A hard end of the inserter's session ends its transaction, and the lock with it
            # (the second argument: wait, up to the hang guard, until the backend is gone).
            pid = inserters[1].get_server_pid()
            assert await conn.fetchval("SELECT pg_terminate_backend($1, $2)", pid, 30_000)
            assert await listener.arm() is Armed.LOOK
            assert await listener.arm() is Armed.SLEEP  # every insert since rings
            assert listener.arms == 1
            await work.options(queue="mail").defer(conn)
            assert await bell.next() == "ring"
            assert bell.pending() == []  # the inserts in flight rang nothing at their end
    finally:
        for inserter in inserters:
            inserter.terminate()


async def test_a_ring_since_the_last_arm_leaves_it_unarmed_until_the_listener_disarms(
    dsn: str,
) -> None:
    """The producer armed; a ring came; before the listener disarmed, the producer (whose last
    look began before the ringing insert committed) arms again. The doorbell must not count as
    armed then: the producer is about to claim, not to sleep, and a worker left on duty while
    it works has every insert ring for nothing."""
    conn = await asyncpg.connect(dsn)
    try:
        watch = Watch(schema="aioq", queues={"default"}, within=HANG_GUARD)
        watch.begin(conn)
        assert await watch.arm() is Armed.LOOK
        assert watch.armed
        assert watch.rung("default")  # the listener then disarms it, when it gets the session
        assert await watch.arm() is Armed.LOOK  # the producer looks; nothing is armed
        assert not watch.armed
        assert watch.resting  # locks held while nobody sleeps on them: the listener disarms
        async with watch.talk:
            await watch.disarm(conn)
        assert not watch.resting
        assert await watch.arm() is Armed.LOOK  # armed afresh, and looked once more
        assert watch.armed
        assert await watch.arm() is Armed.SLEEP
        assert not watch.rung("elsewhere")  # another worker's queue: not ours
        assert watch.armed
    finally:
        await conn.close()
