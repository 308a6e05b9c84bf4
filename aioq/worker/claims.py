"""The claims a worker holds: one owner for them, keyed by a claim identity never reused.

The producer adds claims, the consumer runs them, the completer settles them once their outcome
is written, the heartbeat extends them and cancels the ones it finds lost, and shutdown cancels
and releases what is left. None of them touches the others' bookkeeping: they all go through
:class:`Claims`. A claim is keyed by ``(job id, claim number)``, so a stale claim of a job (a
write whose reply was lost, a lease lost to another worker) can never be mistaken for a later
claim of the same job by the same worker.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from aioq.job import Claim, ClaimKey

__all__ = ("CancelReason", "Claims", "Running")


class CancelReason(enum.Enum):
    """Why the worker stops the local run of a claim."""

    LEASE_LOST = "lease lost"  # another worker owns the job now
    SHUTDOWN = "shutdown"  # the grace period of a stop ran out
    CANCELLED = "cancel requested"  # aioq.admin.cancel_jobs asked for it


@dataclass(slots=True, eq=False)
class Running:
    """A claim this worker holds, from the claim until its outcome is written."""

    claim: Claim
    scope: anyio.CancelScope | None = None
    finished: bool = False  # the outcome is with the completer
    cancel_reason: CancelReason | None = None
    in_thread: bool = False  # a plain def task's thread runs it: it cannot be interrupted
    # A cancel request reached this run (current_job().cancel_requested); the run
    # ends `cancelled` whatever it does next.
    cancel_requested: bool = False
    # A plain def task's thread found the lease may have lapsed as it began and did not call the
    # task: the job is given back, whatever a middleware around the call made of it.
    not_started: bool = False
    # When the statement that last set the lease (the claim, then each beat) was sent, in
    # time.monotonic() seconds: the database set the lease no earlier, so the lease holds at
    # least until extended_at + lease on our clock.
    extended_at: float = field(default_factory=time.monotonic)
    # An earlier claim of the same job this worker still held when it claimed it again (its
    # loop was blocked past the lease, and the job was rescued): lost, its run may go on.
    older: Running | None = None
    _ended: anyio.Event | None = None  # made by a waiter of ended(): few runs have one

    def lapsed(self, now: float) -> bool:
        """Whether the lease may have run out by ``now`` (time.monotonic()): a job whose lease
        may have lapsed is never started (docs/architecture.md, "Leases")."""
        return now >= self.extended_at + self.claim.lease

    def end(self) -> None:
        """Note that the local run of this claim ended (it was started and returned)."""
        self.scope = None
        if self._ended is not None:
            self._ended.set()

    async def ended(self) -> None:
        """Return once the local run of this claim ended (at once if none runs)."""
        if self.scope is not None:
            if self._ended is None:
                self._ended = anyio.Event()
            await self._ended.wait()

    def cancel(self, reason: CancelReason) -> None:
        """Stop the local execution of this job (a thread runs on until it returns)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
        if self.scope is not None:
            self.scope.cancel()


class Claims:
    """The running claims of one worker; the only place that tracks them."""

    def __init__(self) -> None:
        self._running: dict[ClaimKey, Running] = {}
        self._newest: dict[int, Running] = {}  # job id -> its newest claim held
        self._added = anyio.Event()
        # Since the last wait_added: when the first claim was added, the shortest lease.
        self._first_added = math.inf
        self._shortest_added = math.inf
        self._threads = 0  # claims whose task runs in a thread now
        self._no_threads = anyio.Event()

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, claim: Claim) -> bool:
        return claim.key in self._running

    def add(self, claims: Sequence[Claim], *, extended_at: float | None = None) -> None:
        """Track newly claimed jobs (and wake whoever waits for new claims: the heartbeat).

        ``extended_at``: when the claim statement was sent (time.monotonic()); now if None.
        """
        if not claims:
            return
        now = time.monotonic() if extended_at is None else extended_at
        shortest = self._shortest_added
        newest = self._newest
        for claim in claims:
            running = self._running[claim.key] = Running(claim, extended_at=now)
            older = newest.get(claim.id)
            newest[claim.id] = running
            if older is not None and not older.finished:
                # We claimed a job we still hold: the earlier claim is lost (its lease lapsed
                # and the job was rescued). Its run stops; the new one waits for it to end.
                older.cancel(CancelReason.LEASE_LOST)
                running.older = older
            if claim.lease < shortest:
                shortest = claim.lease
        self._shortest_added = shortest
        self._first_added = min(self._first_added, now)
        self._added.set()

    def get(self, claim: Claim) -> Running | None:
        """Return the running state of this claim, if it is still held."""
        return self._running.get(claim.key)

    def finish(self, claim: Claim) -> None:
        """Note that the claim's outcome is with the completer (no longer a leftover)."""
        running = self._running.get(claim.key)
        if running is not None:
            running.finished = True

    def settle(self, claim: Claim) -> None:
        """Forget a claim: its outcome is written, or it is lost to another worker."""
        running = self._running.pop(claim.key, None)
        if running is not None and self._newest.get(claim.id) is running:
            del self._newest[claim.id]

    def held(self) -> list[Running]:
        """Every claim held now (a snapshot: the caller may await while using it)."""
        return list(self._running.values())

    def held_ids(self) -> list[int]:
        """The ids of the jobs held now."""
        return [key[0] for key in self._running]

    def leftovers(self) -> list[Claim]:
        """Claims held with no outcome handed to the completer (to release on shutdown)."""
        return [r.claim for r in self._running.values() if not r.finished]

    def threads(self) -> list[Running]:
        """Claims whose task runs in a thread now."""
        return [r for r in self._running.values() if r.in_thread] if self._threads else []

    def enter_thread(self, running: Running) -> None:
        """Note that a claim's task now runs in a thread (it cannot be interrupted)."""
        running.in_thread = True
        self._threads += 1

    def leave_thread(self, running: Running) -> None:
        """Note that a claim's thread returned."""
        running.in_thread = False
        self._threads -= 1
        if not self._threads:
            self._no_threads.set()
            self._no_threads = anyio.Event()

    async def wait_threads_done(self) -> None:
        """Return once no claim's task runs in a thread."""
        if self._threads:
            await self._no_threads.wait()

    def cancel_all(self, reason: CancelReason) -> list[Running]:
        """Cancel the local run of every claim that has one; return those."""
        cancelled = [r for r in self._running.values() if r.scope is not None]
        for running in cancelled:
            running.cancel(reason)
        return cancelled

    async def wait_added(self, seconds: float) -> tuple[float, float] | None:
        """Wait at most ``seconds`` for claims to be added (since the last call).

        Return when the first of them was added and the shortest of their leases (their
        leases need extending no earlier than that), or None if none was added.
        """
        with anyio.move_on_after(seconds):
            await self._added.wait()
        if not self._added.is_set():
            return None
        self._added = anyio.Event()
        added = (self._first_added, self._shortest_added)
        self._first_added = self._shortest_added = math.inf
        return added
