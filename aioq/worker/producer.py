"""Claim jobs for free consumer slots (and a few ahead): one statement per claim, woken by the
doorbell or a tick."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus

from aioq import hooks
from aioq.doorbell import Armed, Doorbell
from aioq.job import Claim, OutcomeKind
from aioq.worker.claimer import Claimer
from aioq.worker.claims import Claims
from aioq.worker.completer import Completer, Outcome
from aioq.worker.notifier import Listener
from aioq.worker.service import Service

if TYPE_CHECKING:
    from aioq.metrics import Metrics

__all__ = ("ClaimAhead", "Handoff", "Producer", "Slots")

logger = logging.getLogger(__name__)

_FASTEST_POLL = 16  # polling without NOTIFY speeds up to poll_interval / 16 while jobs come
# While an insert that did not ring is in flight, the producer looks again after this pause,
# doubled each time: most such inserts were autocommit statements a WAL flush from committing.
_FIRST_RECHECK = 0.001
# Claim-ahead (prefetch "auto"): the consumers' pace is measured over windows this long; the
# claim round trip is a moving average (each new claim counts for this share).
RATE_WINDOW = 0.02
ROUND_TRIP_WEIGHT = 0.2
# A claimed-ahead job goes back to the table when no consumer frees up for this many claim
# round trips (at least LINGER_FLOOR seconds): it waits behind long jobs, and another worker
# may be idle.
LINGER_ROUND_TRIPS = 10
LINGER_FLOOR = 0.05


class Slots:
    """Counts claims between the claim and the end of their consumer's work.

    ``size`` is the consumers; ``ahead`` is how many claims may wait beyond them now (the
    producer sets it before each claim, see :class:`ClaimAhead`).
    """

    def __init__(self, size: int, ahead: int = 0) -> None:
        self.size = size
        self.ahead = ahead
        self.busy = 0
        self.taken = 0  # claims ever taken: tells run_until_idle whether anything ran
        self.given = 0  # slots ever freed: the consumers' pace (ClaimAhead)
        self._freed = anyio.Event()
        self._emptied = anyio.Event()  # its own event: wait_free replaces _freed

    @property
    def free(self) -> int:
        """How many more jobs can be claimed now."""
        return self.size + self.ahead - self.busy

    def take(self, n: int) -> None:
        """Occupy ``n`` slots with newly claimed jobs."""
        self.busy += n
        self.taken += n

    def give(self) -> None:
        """Free one slot."""
        self.busy -= 1
        self.given += 1
        self._freed.set()
        if self.busy == 0:
            self._emptied.set()

    def wake(self) -> None:
        """Wake a waiter without freeing a slot (to make it look at the stop flag)."""
        self._freed.set()

    async def wait_free(self) -> None:
        """Return once a slot is free, or :meth:`wake` was called."""
        if self.busy >= self.size + self.ahead:
            self._freed = anyio.Event()
            await self._freed.wait()

    async def wait_idle(self) -> None:
        """Return once no slot is busy (for one waiter: run_until_idle's)."""
        while self.busy:
            if self._emptied.is_set():
                self._emptied = anyio.Event()
            await self._emptied.wait()


class ClaimAhead:
    """How many jobs to claim beyond the free consumers: ``fixed``, or (auto) the jobs the
    consumers will start within one claim round trip.

    A job claimed k places ahead of the consumers waits about k / rate for one, rate being how
    fast they finish jobs; claimed ahead, it saves the round trip of the claim that would
    otherwise start when a consumer frees up. floor(rate x round trip) is the most that never
    waits longer than the round trip it saves: about the concurrency for no-op jobs, none for
    jobs much longer than a round trip (50 ms jobs at c10: 200/s x 1 ms), and none while idle
    (no pace measured). At most ``limit`` (the concurrency). When the consumers stop freeing
    up (the next jobs are long), the jobs claimed ahead go back: see :meth:`linger`.
    """

    def __init__(self, *, fixed: int | None, limit: int) -> None:
        self.fixed = fixed
        self.limit = limit
        self.rate = 0.0  # slots freed per second over the last full window
        self.round_trip = 0.0  # seconds per claim (moving average)
        self._window_start = 0.0
        self._window_given = 0

    def size(self, given: int, now: float) -> int:
        """How many claims may wait beyond the consumers; ``given``: Slots.given, ``now``:
        time.monotonic()."""
        if self.fixed is not None:
            return self.fixed
        elapsed = now - self._window_start
        if elapsed >= RATE_WINDOW:
            self.rate = (given - self._window_given) / elapsed
            self._window_start, self._window_given = now, given
        return min(self.limit, int(self.rate * self.round_trip))

    def observe(self, seconds: float) -> None:
        """Count one claim's round trip."""
        if self.round_trip:
            self.round_trip += ROUND_TRIP_WEIGHT * (seconds - self.round_trip)
        else:
            self.round_trip = seconds

    def linger(self) -> float | None:
        """How long claimed-ahead jobs wait for a consumer before they go back (None: forever).

        A fixed prefetch keeps them: the user asked for that many ahead, and giving them back
        would only claim them again.
        """
        if self.fixed is not None:
            return None
        return max(LINGER_FLOOR, LINGER_ROUND_TRIPS * self.round_trip)

    def gave_back(self, given: int, now: float) -> None:
        """Start the pace afresh after claims went back: claim ahead again once it is measured."""
        self.rate = 0.0
        self._window_start, self._window_given = now, given


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

    @property
    def waiting(self) -> int:
        """How many claims wait for a consumer."""
        return len(self._claims)

    def take(self) -> list[Claim]:
        """Remove and return the claims no consumer has taken yet."""
        claims = list(self._claims)
        self._claims.clear()
        return claims

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


class Producer(Service[tuple[int, int]]):
    """Claims for the free slots and the claim-ahead in one statement; hands jobs to consumers."""

    name = "producer"

    def __init__(
        self,
        *,
        claimer: Claimer,
        claims: Claims,
        slots: Slots,
        doorbell: Doorbell,
        stopping: anyio.Event,
        poll_interval: float,
        batch_size: int,
        ahead: ClaimAhead | None = None,
        completer: Completer | None = None,
        listener: Listener | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__()
        self.claimer = claimer
        self.claims = claims
        self.slots = slots
        self.doorbell = doorbell
        self.stopping = stopping
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.ahead = ahead if ahead is not None else ClaimAhead(fixed=0, limit=0)
        self.completer = completer  # writes the release of claims given back (auto claim-ahead)
        self.listener = listener  # before sleeping: arm the doorbell (None: polling only)
        self.metrics = metrics
        self.handoff = Handoff()
        self._found_all = False  # the last claim took every ready job
        self._recheck = 0.0  # the pause before looking again for an insert in flight (wait())
        self._poll_delay = poll_interval
        self.last_claim_seconds = 0.0
        # Rows may be running under our id that we hold no claim for: a claim failed (it may
        # have committed with its reply lost), or, at start, a previous process with the same
        # worker id left them. The next pass releases them first.
        self.orphans = True
        self.started = 0  # passes started: numbers them
        self.last_pass = 0  # the number of the last pass that claimed (see run_until_idle)

    async def run_once(self) -> tuple[int, int]:
        """Claim up to the free slots and the claim-ahead; return (claimed, asked)."""
        self.started += 1
        number = self.started
        self.slots.ahead = self.ahead.size(self.slots.given, time.monotonic())
        asked = min(self.slots.free, self.batch_size)
        if asked <= 0:
            return 0, 0
        if self.orphans:
            await self._release_orphans()
        # The lease of a claim runs from the statement's start: what a consumer checks before
        # it starts the job (docs/architecture.md, "Leases").
        sent = time.monotonic()
        start_ns = time.time_ns() if hooks.observers else 0
        self.orphans = True  # until the reply is in: a cancel or an error may lose it
        claims = await self.claimer.claim(asked)
        self.orphans = False
        self.last_claim_seconds = time.monotonic() - sent
        self.ahead.observe(self.last_claim_seconds)
        if hooks.observers and claims:  # aioq.hooks: tracing, the test drain
            hooks.claimed(self.claimer.worker_id, claims, start_ns, time.time_ns())
        if self.metrics is not None:
            self.metrics.observe_claim(claims, self.last_claim_seconds)
        self.slots.take(len(claims))
        self.claims.add(claims, extended_at=sent)
        self.handoff.put(claims)
        self.last_pass = number
        return len(claims), asked

    async def _release_orphans(self) -> None:
        """Give back the rows a claim whose reply was lost took under our id.

        Only the producer adds claims, so between its passes the claims held are exactly the
        rows running under our id that we know of: any other is an orphan nobody heartbeats.
        """
        released = await self.claimer.release(keep=self.claims.held_ids())
        self.orphans = False
        if released:
            logger.warning(
                "released %d jobs claimed by a claim whose reply was lost",
                len(released),
                extra={"released": len(released)},
            )

    def stop(self) -> None:
        """Stop claiming; wakes the producer wherever it waits."""
        self.stopping.set()
        self.doorbell.ring()
        self.slots.wake()

    def stopped(self) -> bool:
        """Whether the worker stopped claiming."""
        return self.stopping.is_set()

    def busy(self, result: tuple[int, int]) -> bool:
        """A claim got all it asked for: more may be ready, claim again once a slot is free."""
        claimed, asked = result
        if claimed == asked and asked > 0:
            return True
        if asked:
            self._next_poll_delay(claimed)
            self._found_all = True  # nothing more is ready: wait() arms the doorbell
        return False

    def interval(self) -> float:
        """The current poll delay (see :meth:`_next_poll_delay`).

        Shorter when a rate-limited queue held jobs back: its window may open before the poll.
        """
        return min(self._poll_delay, self.claimer.wake_after)

    async def wait(self, seconds: float) -> None:
        """Wait for a free slot; then, if the last claim found nothing more, for a ring or a poll.

        The worker rings the doorbell to stop, a NOTIFY rings it for new jobs. Before sleeping
        it arms the doorbell (docs/architecture.md, "The doorbell"), and looks once more for what an insert that ran
        before could have left unrung; while such an insert is in flight, it looks again after
        pauses that double from a millisecond, and sleeps only once none is. A wildcard that
        rang for a queue we do not watch is armed again after its pause.
        """
        if self.slots.free <= 0:  # below 0 when the claim-ahead shrank
            await self._wait_free()
            return
        found_all, self._found_all = self._found_all, False
        if found_all and self.listener is not None:
            if self._recheck and await self.doorbell.wait(self._recheck):
                self._recheck = 0.0
                return  # rung: claim
            armed = await self.listener.arm(self.claimer.claimable())
            while armed is Armed.LATER:
                # The wildcard rang for a queue we do not watch: arm it after its pause.
                self._recheck = 0.0
                pause = self.listener.later()
                if pause >= seconds:
                    await self.doorbell.wait(seconds)  # the poll comes first
                    return
                if await self.doorbell.wait(pause):
                    return  # rung: claim
                armed = await self.listener.arm(self.claimer.claimable())
            if armed is Armed.LOOK_AGAIN:
                self._recheck = min(2 * self._recheck or _FIRST_RECHECK, seconds)
                return
            self._recheck = 0.0
            if armed is Armed.LOOK:
                return
        await self.doorbell.wait(seconds)

    async def _wait_free(self) -> None:
        """Wait for a free slot; give back the claimed-ahead jobs if none frees in time.

        The prefetch trap (Celery's): claimed ahead behind jobs that turn out long, a job would
        wait for this worker while another one may be idle. Back in the table (its attempt
        refunded, its queue rung), whichever worker frees up first takes it.
        """
        linger = self.ahead.linger() if self.handoff.waiting else None
        if linger is None or self.completer is None:
            await self.slots.wait_free()
            return
        with anyio.move_on_after(linger) as waited:
            await self.slots.wait_free()
        if waited.cancelled_caught and not self.stopping.is_set() and self._all_running():
            self._give_back(self.completer)

    def _all_running(self) -> bool:
        """Whether every consumer runs a job now: only then can claimed-ahead jobs be stuck
        behind long ones.

        A consumer that ran its job and waits for the completer's room (the database is
        behind) is free: it takes the next claim as soon as the batch being written is in.
        Giving claims back then only adds releases to what the database must write, and
        claims them again: at concurrency 1 000, with the completer slowed down, a drain gave
        back 1 000 jobs at a time and claimed each job two or three times. The linger starts
        again instead.
        """
        return self.slots.busy - self.handoff.waiting >= self.slots.size

    def _give_back(self, completer: Completer) -> None:
        """Release the claims no consumer has taken (fenced, attempt refunded)."""
        claims = self.handoff.take()
        for claim in claims:
            completer.put(Outcome(claim, OutcomeKind.RELEASED))
            self.slots.give()
        if claims:
            self.ahead.gave_back(self.slots.given, time.monotonic())
            logger.debug(
                "gave back %d jobs claimed ahead: no consumer freed up in %.3fs",
                len(claims),
                self.ahead.linger(),
            )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Claim until stopped; then close the handoff so the consumers finish."""
        try:
            await super().run(task_status=task_status)
        finally:
            self.handoff.close()

    def _next_poll_delay(self, claimed: int) -> float:
        """The poll interval; shorter while polls without NOTIFY keep finding jobs.

        Without a doorbell, jobs that trickle in would wait half an interval on average: while
        polls find work the delay halves (down to 1/16), and each empty poll doubles it back,
        so an idle queue still costs one query per interval.
        """
        if self.listener is not None and self.listener.connected.is_set():
            self._poll_delay = self.poll_interval
        elif claimed:
            self._poll_delay = max(self._poll_delay / 2, self.poll_interval / _FASTEST_POLL)
        else:
            self._poll_delay = min(self._poll_delay * 2, self.poll_interval)
        return self._poll_delay
