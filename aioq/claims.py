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
    CANCELLED = "cancel requested"  # aioq.cancel_jobs asked for it (jobcontrol)


@dataclass(slots=True, eq=False)
class Running:
    """A claim this worker holds, from the claim until its outcome is written."""

    claim: Claim
    scope: anyio.CancelScope | None = None
    finished: bool = False  # the outcome is with the completer
    cancel_reason: CancelReason | None = None
    in_thread: bool = False  # a plain def task's thread runs it: it cannot be interrupted
    # jobcontrol: a cancel request reached this run (current_job().cancel_requested); the run
    # ends `cancelled` whatever it does next.
    cancel_requested: bool = False
    # When the lease was last extended (the claim counts), in time.monotonic() seconds.
    extended_at: float = field(default_factory=time.monotonic)

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
        self._added = anyio.Event()
        # Since the last wait_added: when the first claim was added, the shortest lease.
        self._first_added = math.inf
        self._shortest_added = math.inf

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, claim: Claim) -> bool:
        return claim.key in self._running

    def add(self, claims: Sequence[Claim]) -> None:
        """Track newly claimed jobs (and wake whoever waits for new claims: the heartbeat)."""
        if not claims:
            return
        now = time.monotonic()  # no later than the new claims' extended_at
        shortest = self._shortest_added
        for claim in claims:
            self._running[claim.key] = Running(claim)
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
        self._running.pop(claim.key, None)

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
        return [r for r in self._running.values() if r.in_thread]

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
