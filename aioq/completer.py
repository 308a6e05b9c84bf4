"""Write the outcomes of finished attempts, fenced on their claims, batched under load."""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import asyncpg

from aioq import hooks
from aioq._service import STEP_BACKOFF, Service
from aioq.backoff import Failures
from aioq.claims import Claims
from aioq.job import Claim, ClaimKey, OutcomeKind
from aioq.store import Executor, Store

if TYPE_CHECKING:
    from aioq.metrics import Metrics
    from aioq.stats_history import StatsRecorder

__all__ = ("Completer", "Outcome")

logger = logging.getLogger(__name__)

# Errors about an outcome's data, not the connection: retrying the same batch cannot help
# (a value out of range, an archive row that clashes). The batch is split to find the row.
_REFUSED = (
    asyncpg.DataError,
    asyncpg.IntegrityConstraintViolationError,
    UnicodeError,
    OverflowError,
)


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of one attempt, to be written fenced on its claim."""

    claim: Claim
    kind: OutcomeKind
    duration: float = 0.0
    delay: float = 0.0
    error: str | None = None
    # jobcontrol: the task's result_ttl (None: it keeps no result, and nobody awaits the job)
    # and its return value as JSON text, for COMPLETE.
    result_ttl: float | None = None
    result: str | None = None


class Completer(Service):
    """Apply outcomes in as few statements as possible: one per kind per flush."""

    name = "completer"

    def __init__(
        self,
        *,
        store: Store,
        db: Executor,
        worker_id: str,
        claims: Claims,
        keep_completed: bool,
        batch_size: int,
        max_pending: int,
    ) -> None:
        super().__init__()
        self.store = store
        self.db = db
        self.worker_id = worker_id
        self.claims = claims
        self.keep_completed = keep_completed
        self.batch_size = batch_size
        self.max_pending = max_pending
        self.metrics: Metrics | None = None  # the worker sets it when metrics are on
        self.history: StatsRecorder | None = None  # the worker sets it when history is on
        # Called with each group of outcomes once written (queue limits: room again).
        self.on_written: Callable[[list[Outcome]], None] | None = None
        self.pending: list[Outcome] = []
        self._unsure: set[ClaimKey] = set()  # claims whose write failed: maybe written
        self._dropped: set[ClaimKey] = set()  # outcomes the server refused, already logged
        self._lock = anyio.Lock()  # the run loop and a shutdown flush never write one batch twice
        self._wake = anyio.Event()
        self._room = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()

    async def put(self, outcome: Outcome) -> None:
        """Queue an outcome; wait while too many are unwritten (the database is behind)."""
        while len(self.pending) >= self.max_pending:
            if self._room.is_set():
                self._room = anyio.Event()
            await self._room.wait()
        self.claims.finish(outcome.claim)
        if not self.pending and self._idle.is_set():  # never set while outcomes are queued
            self._idle = anyio.Event()
        self.pending.append(outcome)
        self._wake.set()

    def lost(self, claim: Claim) -> None:
        """Forget a claim whose lease was lost: another worker owns the job now."""
        self.claims.settle(claim)
        if self.metrics is not None:
            self.metrics.observe_lease_lost(claim)
        logger.warning(
            "job %s: lease lost, local execution dropped",
            claim.id,
            extra=_extra(claim, "lease_lost", 0.0),
        )

    async def wait_idle(self) -> None:
        """Return once every queued outcome is written."""
        await self._idle.wait()

    async def run_once(self) -> int:
        """Write up to ``batch_size`` queued outcomes; return how many were written.

        One statement per kind of outcome. If one fails (the connection broke), the kinds
        written before it leave the queue and only the rest is tried again: rewriting them
        would find their rows gone and report leases as lost.
        """
        async with self._lock:
            batch = self.pending[: self.batch_size]
            if not batch:
                return 0
            by_kind: dict[OutcomeKind, list[Outcome]] = defaultdict(list)
            for outcome in batch:
                by_kind[outcome.kind].append(outcome)
            written: list[Outcome] = []
            try:
                for kind, group in by_kind.items():
                    start_ns = time.time_ns() if hooks.observers else 0
                    try:
                        kept = await self._write_isolating(kind, group)
                    except BaseException:
                        # The statement may have committed with only its reply lost: when the
                        # retry finds these rows gone, that is no proof of a lost lease.
                        self._unsure.update(o.claim.key for o in group)
                        raise
                    written += group
                    self._settle(group, kept)
                    if hooks.observers:  # aioq.hooks: tracing, the test drain
                        mine = [(o.claim, o.error) for o in group if o.claim.id in kept]
                        hooks.settled(self.worker_id, kind.value, mine, start_ns, time.time_ns())
                    if self.on_written is not None:
                        self.on_written(group)
            finally:
                if len(written) == len(batch):
                    del self.pending[: len(batch)]
                elif written:
                    done = {id(o) for o in written}
                    self.pending[: len(batch)] = [o for o in batch if id(o) not in done]
                if written:
                    self._room.set()
                if not self.pending:
                    self._idle.set()
        return len(batch)

    def _settle(self, outcomes: list[Outcome], kept: set[int]) -> None:
        """Forget written claims; count and log each (kept, or found lost)."""
        settle, metrics, history = self.claims.settle, self.metrics, self.history
        # Per batch, not per job: the hot path builds no message nor extras nobody reads.
        log_info = logger.isEnabledFor(logging.INFO)
        log_bury = logger.isEnabledFor(logging.WARNING)
        for outcome in outcomes:
            claim = outcome.claim
            settle(claim)
            unsure = False
            if self._unsure:
                unsure = claim.key in self._unsure
                self._unsure.discard(claim.key)
            if self._dropped and claim.key in self._dropped:
                self._dropped.discard(claim.key)
                continue
            if claim.id in kept:
                if metrics is not None:
                    metrics.observe_outcome(claim, outcome.kind, outcome.duration)
                if history is not None:
                    history.observe(claim, outcome.kind, outcome.duration)
                buried = outcome.kind is OutcomeKind.BURY
                if not (log_bury if buried else log_info):
                    continue
                logger.log(
                    logging.WARNING if buried else logging.INFO,
                    "job %s %s %s (attempt %s/%s, %.3fs)%s",
                    claim.id,
                    claim.task,
                    outcome.kind.value,
                    claim.attempt,
                    claim.max_attempts,
                    outcome.duration,
                    f": {outcome.error.splitlines()[0]}" if outcome.error else "",
                    extra=_extra(claim, outcome.kind.value, outcome.duration),
                )
            elif unsure:
                logger.info(
                    "job %s %s: its outcome (%s) was found already gone on retry: written"
                    " before the connection dropped, or taken over by another worker",
                    claim.id,
                    claim.task,
                    outcome.kind.value,
                    extra=_extra(claim, "unconfirmed", outcome.duration),
                )
            else:
                if self.metrics is not None:
                    self.metrics.observe_lease_lost(claim)
                logger.warning(
                    "job %s %s: lease lost before its outcome (%s) was written; the new"
                    " owner's state stands",
                    claim.id,
                    claim.task,
                    outcome.kind.value,
                    extra=_extra(claim, "lease_lost", outcome.duration),
                )

    async def _write_isolating(self, kind: OutcomeKind, group: list[Outcome]) -> set[int]:
        """Write outcomes of one kind; if the server refuses their data, write one by one.

        A refused completion is written without its archive copy; any other refused outcome
        is dropped, loudly: not lost work, since the claim is settled (no longer heartbeated),
        its lease expires and the job runs again. Connection errors propagate, and the group
        is tried again later.
        """
        try:
            return await self._write(kind, group)
        except _REFUSED:
            if len(group) == 1:
                return await self._write_refused(kind, group[0])
        kept: set[int] = set()
        for outcome in group:
            kept |= await self._write_isolating(kind, [outcome])
        return kept

    async def _write_refused(self, kind: OutcomeKind, outcome: Outcome) -> set[int]:
        claim = outcome.claim
        if kind is OutcomeKind.COMPLETE and self.keep_completed:
            logger.exception(
                "job %s %s: its archive row cannot be stored; completing it without one",
                claim.id,
                claim.task,
            )
            try:
                return await self.store.complete(
                    self.db, [claim.id], [claim.number], self.worker_id
                )
            except _REFUSED:
                pass
        logger.exception(
            "job %s %s: its outcome (%s) cannot be stored; dropped, the job runs again once"
            " its lease expires",
            claim.id,
            claim.task,
            kind.value,
        )
        self._dropped.add(claim.key)
        return set()

    async def _write(self, kind: OutcomeKind, group: list[Outcome]) -> set[int]:
        store, db, me = self.store, self.db, self.worker_id
        ids = [o.claim.id for o in group]
        numbers = [o.claim.number for o in group]
        if kind is OutcomeKind.COMPLETE:
            if any(o.result_ttl is not None for o in group):  # jobcontrol: stored results
                return await self._complete_results(group)
            return await store.complete(db, ids, numbers, me, archive=self.keep_completed)
        if kind is OutcomeKind.CANCEL:  # jobcontrol
            awaited = [o.result_ttl is not None for o in group]
            return await store.cancel_running(db, ids, numbers, me, awaited=awaited)
        if kind is OutcomeKind.BURY:
            kept = await store.bury(db, ids, numbers, me, errors=[o.error or "dead" for o in group])
            # jobcontrol: wake whoever awaits these (a second statement, dead jobs only)
            rung = sorted(kept.intersection(o.claim.id for o in group if o.result_ttl is not None))
            if rung:
                await store.ring_results(db, rung)
            return kept
        return await store.reschedule(
            db,
            ids,
            numbers,
            me,
            delays=[o.delay for o in group],
            errors=[o.error if kind is OutcomeKind.FAIL else None for o in group],
            refunds=[kind is OutcomeKind.RELEASE] * len(group),
            snoozes=[kind is OutcomeKind.SNOOZE] * len(group),
        )

    async def _complete_results(self, group: list[Outcome]) -> set[int]:
        """Write completions of a group where some keep their return value (jobcontrol)."""
        store, db, me = self.store, self.db, self.worker_id
        plain = [o for o in group if o.result_ttl is None]
        kept: set[int] = set()
        if plain:
            kept = await store.complete(
                db,
                [o.claim.id for o in plain],
                [o.claim.number for o in plain],
                me,
                archive=self.keep_completed,
            )
        stored = [o for o in group if o.result_ttl is not None]
        return kept | await store.complete_result(
            db,
            [o.claim.id for o in stored],
            [o.claim.number for o in stored],
            me,
            results=[o.result if o.result is not None else "null" for o in stored],
            ttls=[o.result_ttl or 0.0 for o in stored],
            archive=self.keep_completed,
        )

    @property
    def idle(self) -> bool:
        """Whether every queued outcome is written."""
        return not self.pending

    def interval(self) -> float:
        """No clock: the completer waits for outcomes (see :meth:`wait`)."""
        return math.inf

    def busy(self, result: object) -> bool:
        """More outcomes queued up during the last write: write them at once."""
        return bool(self.pending)

    async def wait(self, seconds: float) -> None:
        """After a failure, the backoff; otherwise until an outcome comes."""
        if self.failures.count:
            await anyio.sleep(seconds)
            return
        await self._wake.wait()
        self._wake = anyio.Event()

    def log_failure(self, exc: Exception, delay: float) -> None:
        """Report a failed write; the outcomes stay queued."""
        logger.error("writing job outcomes failed; retrying in %.2fs", delay, exc_info=exc)

    async def flush(self) -> None:
        """Write everything queued now (on shutdown); give up after errors persist."""
        failures = Failures(STEP_BACKOFF)
        while self.pending:
            try:
                await self.run_once()
            except Exception:
                if failures.count >= 5:
                    logger.exception(
                        "could not write %d job outcomes; their leases will expire and"
                        " the jobs will run again",
                        len(self.pending),
                    )
                    return
                await anyio.sleep(failures.next())


def _extra(claim: Claim, outcome: str, duration: float) -> dict[str, object]:
    return {
        "job_id": claim.id,
        "task": claim.task,
        "queue": claim.queue,
        "attempt": claim.attempt,
        "duration_s": round(duration, 6),
        "outcome": outcome,
    }
