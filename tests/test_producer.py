"""The producer's pieces without a database: the claim handoff and the poll delay."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio
import pytest

from aioq.doorbell import Armed, Doorbell
from aioq.job import Claim, OutcomeKind
from aioq.worker.claims import Claims
from aioq.worker.completer import Completer, Outcome
from aioq.worker.producer import ClaimAhead, Handoff, Producer, Slots

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0


def claim(job_id: int) -> Claim:
    return Claim(
        id=job_id,
        number=1,
        queue="default",
        task="t",
        args="{}",
        priority=0,
        attempt=1,
        max_attempts=3,
        lease=60.0,
        waited=0.0,
    )


async def test_handoff_is_fifo_and_ends_after_close() -> None:
    handoff = Handoff()
    handoff.put([claim(1), claim(2)])
    handoff.put([claim(3)])
    handoff.close()
    got = [await handoff.get() for _ in range(4)]
    assert [c.id if c else None for c in got] == [1, 2, 3, None]


async def test_handoff_wakes_waiting_consumers_and_close_ends_them() -> None:
    handoff = Handoff()
    received: list[int | None] = []

    async def consume() -> None:
        while (c := await handoff.get()) is not None:
            received.append(c.id)
        received.append(None)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            handoff.put([claim(i) for i in range(5)])
            await anyio.wait_all_tasks_blocked()
            assert sorted(x for x in received if x is not None) == list(range(5))
            handoff.close()
    assert received.count(None) == 3


async def test_a_cancelled_waiter_passes_its_wakeup_on() -> None:
    handoff = Handoff()
    first = asyncio.ensure_future(handoff.get())
    second = asyncio.ensure_future(handoff.get())
    await asyncio.sleep(0)  # both wait now
    # Wake the first waiter for one claim and cancel it before it runs: the claim must reach
    # the second waiter instead of sitting in the queue.
    handoff.put([claim(7)])
    first.cancel()
    with anyio.fail_after(10):
        got = await second
    assert got is not None
    assert got.id == 7
    assert first.cancelled()


async def test_a_waiter_cancelled_before_close_wakes_it_ends_quietly() -> None:
    # A hard cancel of the worker cancels the waiting consumers' futures; close() (or put())
    # then drops those futures from the queue as done. The cancelled get() must still raise
    # its CancelledError, not a ValueError from removing a future no longer queued.
    handoff = Handoff()
    waiting = asyncio.ensure_future(handoff.get())
    await asyncio.sleep(0)
    waiting.cancel()  # cancels the inner future now; get() runs its except clause later
    handoff.close()
    with pytest.raises(asyncio.CancelledError):
        await waiting


class FakeClaimer:
    """Claims from a list, as a worker's claimer would from the table; no orphans."""

    worker_id = "w"
    wake_after = float("inf")

    def __init__(self) -> None:
        self.ready: list[Claim] = []
        self.claims = 0

    async def claim(self, limit: int) -> list[Claim]:
        self.claims += 1
        taken, self.ready = self.ready[:limit], self.ready[limit:]
        return taken

    async def release(self, keep: object = ()) -> list[int]:
        return []

    def claimable(self) -> list[str]:
        return ["default"]


class FakeListener:
    """A LISTEN connection that is up (or not); arming it runs ``on_arm``."""

    def __init__(self, connected: bool, on_arm: Callable[[], Armed] = lambda: Armed.SLEEP) -> None:
        self.connected = anyio.Event()
        if connected:
            self.connected.set()
        self.on_arm = on_arm

    async def arm(self, queues: object = None) -> Armed:
        return self.on_arm()


def producer(
    poll_interval: float, listener: FakeListener | None, claimer: FakeClaimer | None = None
) -> Producer:
    return Producer(
        claimer=claimer or FakeClaimer(),  # type: ignore[arg-type]
        claims=Claims(),
        slots=Slots(5),
        doorbell=Doorbell(),
        stopping=anyio.Event(),
        poll_interval=poll_interval,
        batch_size=10,
        listener=listener,  # type: ignore[arg-type]
    )


async def test_polls_without_notify_speed_up_while_they_find_jobs() -> None:
    for listener in (None, FakeListener(connected=False)):
        p = producer(poll_interval=1.6, listener=listener)
        assert [p._next_poll_delay(claimed=1) for _ in range(6)] == [0.8, 0.4, 0.2, 0.1, 0.1, 0.1]
        assert [p._next_poll_delay(claimed=0) for _ in range(6)] == [0.2, 0.4, 0.8, 1.6, 1.6, 1.6]


async def test_polls_keep_the_interval_while_notify_rings() -> None:
    p = producer(poll_interval=1.6, listener=FakeListener(connected=True))
    assert {p._next_poll_delay(claimed=1) for _ in range(6)} == {1.6}


@pytest.mark.parametrize("armed_now", [True, False])
async def test_a_worker_that_arms_looks_again_before_sleeping(armed_now: bool) -> None:
    claimer = FakeClaimer()
    armed = False

    def arm() -> Armed:
        # A job committed by a transaction whose insert ran before the locks were taken:
        # it saw nobody on duty, so it will never ring.
        nonlocal armed
        if armed:
            return Armed.SLEEP  # armed already, like the listener's arm()
        armed = True
        claimer.ready.append(claim(100))
        return Armed.LOOK if armed_now else Armed.SLEEP

    p = producer(60.0, FakeListener(connected=True, on_arm=arm), claimer)
    got = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        with anyio.move_on_after(2):
            got = await p.handoff.get()
        p.stop()
    if armed_now:
        # Armed just now: the producer claimed again before sleeping and found the job.
        assert got is not None
        assert got.id == 100
    else:
        # Armed all along (every insert since rang): it sleeps until a ring or a poll.
        assert claimer.claims == 1


class Ahead(ClaimAhead):
    """The auto claim-ahead (it gives back what lingers) with a pace that claims 2 ahead."""

    def size(self, given: int, now: float) -> int:
        return 2


async def test_claimed_ahead_jobs_stay_while_consumers_wait_for_the_completer() -> None:
    """Give-backs are for claims stuck behind long jobs, not behind a database that is behind.

    Two consumers ran their jobs and wait for the completer's room: they take the claims
    waiting as soon as the batch being written is in, so none goes back however long the
    write takes. Once both consumers run jobs that outlast the linger, the claims behind them
    do go back (the prefetch trap).
    """
    claims = Claims()
    completer = Completer(
        schema="aioq",
        db=None,  # type: ignore[arg-type]  # never writes: the test plays the database
        worker_id="w",
        claims=claims,
        keep_completed=False,
        batch_size=2,
        max_pending=1,
    )
    claimer = FakeClaimer()
    claimer.ready = [claim(i) for i in range(1, 7)]
    slots = Slots(2)
    p = Producer(
        claimer=claimer,  # type: ignore[arg-type]
        claims=claims,
        slots=slots,
        doorbell=Doorbell(),
        stopping=anyio.Event(),
        poll_interval=60.0,
        batch_size=10,
        ahead=Ahead(fixed=None, limit=2),
        completer=completer,
    )
    taken: list[int] = []

    async def consumer() -> None:  # one run: take a claim, finish it, wait for room, take one
        first = await p.handoff.get()
        assert first is not None
        completer.put(Outcome(first, OutcomeKind.SUCCEEDED))
        slots.give()
        await completer.wait_room()
        second = await p.handoff.get()
        assert second is not None
        taken.append(second.id)

    with anyio.fail_after(HANG_GUARD):
        assert await p.run_once() == (4, 4)  # 2 for the consumers, 2 ahead
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            tg.start_soon(consumer)
            await anyio.wait_all_tasks_blocked()  # both finished job 1 or 2, wait for room
            assert await p.run_once() == (2, 2)  # the freed slots: jobs 5 and 6
            assert p.handoff.waiting == 4
            for _ in range(3):  # the write takes three lingers
                await p._wait_free()
                assert not [o for o in completer.pending if o.kind is OutcomeKind.RELEASED]
                assert p.handoff.waiting == 4
            completer.pending.clear()  # the batch is written: room again
            completer._room.set()
        assert sorted(taken) == [3, 4]
        # Both consumers run jobs 3 and 4 now, and no slot frees within the linger: 5 and 6
        # wait behind long jobs and go back.
        await p._wait_free()
        released = [o.claim.id for o in completer.pending if o.kind is OutcomeKind.RELEASED]
        assert sorted(released) == [5, 6]
        assert p.handoff.waiting == 0
