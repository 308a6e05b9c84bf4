"""Claim jobs for free consumer slots: one statement per claim, woken by the doorbell or a tick."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import anyio

from aioq._service import StepBackoff, jittered
from aioq.completer import Completer, Running
from aioq.job import Claim
from aioq.store import Executor, Store

if TYPE_CHECKING:
    from aioq.metrics import Metrics

__all__ = ("Doorbell", "Handoff", "Producer", "Slots")

logger = logging.getLogger(__name__)

_FASTEST_POLL = 16  # polling without NOTIFY speeds up to poll_interval / 16 while jobs come


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


class Slots:
    """Counts claims between the claim and the end of their consumer's work."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.busy = 0
        self._freed = anyio.Event()

    @property
    def free(self) -> int:
        """How many more jobs can be claimed now."""
        return self.size - self.busy

    def take(self, n: int) -> None:
        """Occupy ``n`` slots with newly claimed jobs."""
        self.busy += n

    def give(self) -> None:
        """Free one slot."""
        self.busy -= 1
        self._freed.set()

    def wake(self) -> None:
        """Wake a waiter without freeing a slot (to make it look at the stop flag)."""
        self._freed.set()

    async def wait_free(self) -> None:
        """Return once a slot is free, or :meth:`wake` was called."""
        if self.busy >= self.size:
            self._freed = anyio.Event()
            await self._freed.wait()


class Handoff:
    """Claims on their way from the producer to the consumers, first in first out.

    A consumer takes the next claim without yielding to the event loop when one is there, and
    waits on a bare future only when there is none: per job, this is the cheapest handoff
    asyncio offers (an anyio memory stream costs a checkpoint and an event per item). It never
    blocks the producer, which claims no more than the free slots.
    """

    def __init__(self) -> None:
        self._claims: deque[Claim] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    def put(self, claims: Iterable[Claim]) -> None:
        """Queue claims and wake as many waiting consumers."""
        self._claims.extend(claims)
        self._wake(len(self._claims))

    def close(self) -> None:
        """Let consumers finish the queued claims, then get None."""
        self._closed = True
        self._wake(len(self._waiters))

    async def get(self) -> Claim | None:
        """Return the next claim, waiting for one; None once closed and empty."""
        while not self._claims:
            if self._closed:
                return None
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake(1)  # it was woken for a claim it will not take: pass it on
                elif waiter in self._waiters:  # _wake drops it if it ran since the cancel
                    self._waiters.remove(waiter)
                raise
        return self._claims.popleft()

    def _wake(self, n: int) -> None:
        while n > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                n -= 1


class Producer:
    """Claims up to the free slots in one statement and hands the jobs to the consumers."""

    def __init__(
        self,
        *,
        store: Store,
        db: Executor,
        queues: Sequence[str],
        worker_id: str,
        slots: Slots,
        doorbell: Doorbell,
        in_flight: dict[int, Running],
        completer: Completer,
        poll_interval: float,
        batch_size: int,
        stopping: anyio.Event,
        listening: Callable[[], bool] = lambda: False,
        arm: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.store = store
        self.db = db
        self.queues = list(queues)
        self.worker_id = worker_id
        self.slots = slots
        self.doorbell = doorbell
        self.in_flight = in_flight
        self.completer = completer
        self.poll_interval = poll_interval
        self.listening = listening
        self.arm = arm  # before sleeping: ask inserts to ring (the listener's arm())
        self._poll_delay = poll_interval
        self.batch_size = batch_size
        self.stopping = stopping
        self.last_claim_seconds = 0.0
        self.metrics: Metrics | None = None  # the worker sets it when metrics are on

    async def run_once(self, handoff: Handoff) -> tuple[int, int]:
        """Claim up to the free slots; return (claimed, asked)."""
        asked = min(self.slots.free, self.batch_size)
        if asked <= 0:
            return 0, 0
        started = time.perf_counter()
        claims = await self.store.claim(self.db, self.queues, asked, self.worker_id)
        self.last_claim_seconds = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.observe_claim(claims, self.last_claim_seconds)
        self.slots.take(len(claims))
        for claim in claims:
            self.in_flight[claim.id] = Running(claim)
        handoff.put(claims)
        return len(claims), asked

    def stop(self) -> None:
        """Stop claiming; wakes the producer wherever it waits."""
        self.stopping.set()
        self.doorbell.ring()
        self.slots.wake()

    async def run(self, handoff: Handoff, *, until_idle: bool = False) -> None:
        """Claim until stopped (or, with ``until_idle``, until nothing is ready or running)."""
        backoff = StepBackoff()
        try:
            while not self.stopping.is_set():
                await self.slots.wait_free()
                if self.stopping.is_set():
                    break
                if not self.slots.free:
                    continue
                try:
                    claimed, asked = await self.run_once(handoff)
                except Exception:
                    delay = backoff.next()
                    logger.exception("claiming jobs failed; retrying in %.2fs", delay)
                    await self.doorbell.wait(delay)  # the worker rings it to stop
                    continue
                backoff.reset()
                if claimed == asked:
                    continue  # more may be ready: claim again as soon as a slot is free
                if until_idle and claimed == 0 and await self._idle(handoff):
                    break
                if self.arm is not None and await self.arm():
                    # Armed just now: a job inserted before could have skipped the ring, so
                    # look once more before sleeping (no lost wake-up).
                    continue
                # Nothing more is ready: sleep until a NOTIFY (or, with until_idle, the last
                # running job) rings, or the poll delay passes.
                await self.doorbell.wait(jittered(self._next_poll_delay(claimed)))
        finally:
            handoff.close()

    def _next_poll_delay(self, claimed: int) -> float:
        """The poll interval; shorter while polls without NOTIFY keep finding jobs.

        Without a doorbell, jobs that trickle in would wait half an interval on average: while
        polls find work the delay halves (down to 1/16), and each empty poll doubles it back,
        so an idle queue still costs one query per interval.
        """
        if self.listening():
            self._poll_delay = self.poll_interval
        elif claimed:
            self._poll_delay = max(self._poll_delay / 2, self.poll_interval / _FASTEST_POLL)
        else:
            self._poll_delay = min(self._poll_delay * 2, self.poll_interval)
        return self._poll_delay

    async def _idle(self, handoff: Handoff) -> bool:
        """Whether nothing is ready, running or waiting to be written (for run_until_idle)."""
        if self.slots.busy:
            return False
        await self.completer.wait_idle()
        claimed, _ = await self.run_once(handoff)
        return claimed == 0 and self.slots.busy == 0
