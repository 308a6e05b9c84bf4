"""Write the outcomes of finished attempts, fenced on their claims, batched under load."""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import asyncpg

from aioq import hooks
from aioq.backoff import Failures
from aioq.db import Executor
from aioq.job import Claim, ClaimKey, OutcomeKind
from aioq.sql import results_channel
from aioq.sql.outcomes import COMPLETE, WRITE_OUTCOMES, WRITE_STEP_OUTCOMES, WriteOutcomes
from aioq.worker.claims import Claims
from aioq.worker.service import STEP_BACKOFF, Service

if TYPE_CHECKING:
    from aioq.metrics import Metrics
    from aioq.worker.history import StatsRecorder

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
    # The task's result_ttl (None: it keeps no result, and nobody awaits the job)
    # and its return value as JSON text, for COMPLETE.
    result_ttl: float | None = None
    result: str | None = None


class Completer(Service[int]):
    """Write outcomes in as few statements as possible: one per batch, whatever their kinds."""

    name = "completer"

    def __init__(
        self,
        *,
        schema: str,
        db: Executor,
        worker_id: str,
        claims: Claims,
        keep_completed: bool,
        batch_size: int,
        max_pending: int,
        metrics: Metrics | None = None,
        history: StatsRecorder | None = None,
        on_written: Callable[[Iterable[str]], None] | None = None,
    ) -> None:
        super().__init__()
        self.schema = schema
        self.results_channel = results_channel(schema)
        self.db = db
        self.worker_id = worker_id
        self.claims = claims
        self.keep_completed = keep_completed
        self.batch_size = batch_size
        self.max_pending = max_pending
        self.metrics = metrics
        self.history = history  # the per-minute history: counted here, written by StatsWriter
        # Called with the queues of each batch once written (queue limits: room again).
        self.on_written = on_written
        self.pending: list[Outcome] = []
        self._unsure: set[ClaimKey] = set()  # claims whose write failed: maybe written
        self._dropped: set[ClaimKey] = set()  # outcomes the server refused, already logged
        # Outcomes the server refused, by claim, and the dead outcome written instead.
        self._replaced: dict[ClaimKey, Outcome] = {}
        self._lock = anyio.Lock()  # the run loop and a shutdown flush never write one batch twice
        self._wake = anyio.Event()
        self._room = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()

    async def wait_room(self) -> None:
        """Return once fewer than ``max_pending`` outcomes wait to be written: consumers call
        it before they take a job (the database is behind: take no more work)."""
        while len(self.pending) >= self.max_pending:
            if self._room.is_set():
                self._room = anyio.Event()
            await self._room.wait()

    def put(self, outcome: Outcome) -> None:
        """Queue an outcome to be written; never waits, so no cancel can lose it."""
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
        """Write up to ``batch_size`` queued outcomes in one statement; return how many.

        The statement is atomic: if it fails (the connection broke), the whole batch stays
        queued and is tried again; it may have committed with only its reply lost, so rows
        found gone on the retry are no proof of a lost lease.
        """
        async with self._lock:
            batch = self.pending[: self.batch_size]
            if not batch:
                return 0
            start_ns = time.time_ns() if hooks.observers else 0
            try:
                kept = await self._write_isolating(batch)
            except BaseException:
                self._unsure.update(o.claim.key for o in batch)
                raise
            del self.pending[: len(batch)]
            self._room.set()
            if not self.pending:
                self._idle.set()
            if self._replaced:
                batch = [self._replaced.pop(o.claim.key, o) for o in batch]
            self._settle(batch, kept)
            if hooks.observers:  # aioq.hooks: tracing, the test drain
                end_ns = time.time_ns()
                by_kind: dict[OutcomeKind, list[tuple[Claim, str | None]]] = defaultdict(list)
                for o in batch:
                    if o.claim.key in kept:
                        by_kind[o.kind].append((o.claim, o.error))
                for kind, mine in by_kind.items():
                    hooks.settled(self.worker_id, kind.value, mine, start_ns, end_ns)
            if self.on_written is not None:
                self.on_written({o.claim.queue for o in batch})
        return len(batch)

    def _settle(self, outcomes: list[Outcome], kept: set[ClaimKey]) -> None:
        """Forget written claims; count and log each (kept, or found lost)."""
        settle, metrics, history = self.claims.settle, self.metrics, self.history
        # Per batch, not per job: the hot path builds no message nor extras nobody reads.
        log_info = logger.isEnabledFor(logging.INFO)
        log_dead = logger.isEnabledFor(logging.WARNING)
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
            if claim.key in kept:
                if metrics is not None:
                    metrics.observe_outcome(claim, outcome.kind, outcome.duration)
                if history is not None:
                    history.observe(claim, outcome.kind, outcome.duration)
                dead = outcome.kind is OutcomeKind.DEAD
                if not (log_dead if dead else log_info):
                    continue
                logger.log(
                    logging.WARNING if dead else logging.INFO,
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

    async def _write_isolating(self, batch: list[Outcome]) -> set[ClaimKey]:
        """Write outcomes; if the server refuses their data, write them one by one.

        One job's refused outcome never fails its batch-mates: it is found alone, and its job
        fails instead (dead, the refusal in its ``last_error``; a refused completion is first
        written without its archive copy). Connection errors propagate, and the batch is tried
        again later (docs/architecture.md, "Poison jobs").
        """
        try:
            return await self._write(batch, archive=self.keep_completed)
        except _REFUSED as exc:
            if len(batch) == 1:
                return await self._write_refused(batch[0], exc)
        kept: set[ClaimKey] = set()
        for outcome in batch:
            kept |= await self._write_isolating([outcome])
        return kept

    async def _write_refused(self, outcome: Outcome, refused: BaseException) -> set[ClaimKey]:
        """Write what can be written of an outcome the server refused: a completion without
        its archive copy; else the job dead, saying why. Only if even that is refused is the
        outcome dropped, loudly (the claim is settled: its lease expires and the job runs
        again)."""
        claim = outcome.claim
        if outcome.kind is OutcomeKind.SUCCEEDED and self.keep_completed:
            logger.exception(
                "job %s %s: its archive row cannot be stored; completing it without one",
                claim.id,
                claim.task,
            )
            try:
                return await self._write([outcome], archive=False)
            except _REFUSED as exc:
                refused = exc
        logger.error(
            "job %s %s: its outcome (%s) cannot be stored; the job fails (dead)",
            claim.id,
            claim.task,
            outcome.kind.value,
            exc_info=refused,
        )
        dead = Outcome(
            claim,
            OutcomeKind.DEAD,
            outcome.duration,
            error=_refusal(outcome, refused),
            result_ttl=outcome.result_ttl,
        )
        self._replaced[claim.key] = dead
        try:
            return await self._write([dead], archive=False)
        except _REFUSED:
            logger.exception(
                "job %s %s: its dead outcome cannot be stored either; dropped, the job runs"
                " again once its lease expires",
                claim.id,
                claim.task,
            )
        self._dropped.add(claim.key)
        return set()

    async def _write(self, batch: list[Outcome], *, archive: bool) -> set[ClaimKey]:
        """One fenced statement for every outcome of the batch (docs/architecture.md, "The
        fence"); return the claims written, (job id, claim number): a stale claim of a job
        whose newer claim the batch also holds is not among them."""
        steps = any(o.claim.workflow_id is not None for o in batch)
        if not (archive or steps) and all(
            o.kind is _SUCCEEDED and o.result_ttl is None for o in batch
        ):
            # The hot path: plain completions, the statement that only deletes.
            keys = await COMPLETE.rows(
                self.db,
                self.schema,
                [o.claim.id for o in batch],
                [o.claim.number for o in batch],
                self.worker_id,
            )
            return set(keys)
        # Workflow steps: the same outcomes, and the fan-in of those that succeeded
        # (docs/architecture.md, "Workflows").
        statement = WRITE_STEP_OUTCOMES if steps else WRITE_OUTCOMES
        outcomes = WriteOutcomes(
            ids=[o.claim.id for o in batch],
            claims=[o.claim.number for o in batch],
            worker=self.worker_id,
            kinds=[o.kind.value for o in batch],
            delays=[o.delay for o in batch],
            errors=[o.error for o in batch],
            results=[_kept_result(o) for o in batch],
            ttls=[o.result_ttl for o in batch],
            archive=archive,
            results_channel=self.results_channel,
        )
        keys = await statement.rows(self.db, self.schema, outcomes)
        return set(keys)

    @property
    def idle(self) -> bool:
        """Whether every queued outcome is written."""
        return not self.pending

    def interval(self) -> float:
        """No clock: the completer waits for outcomes (see :meth:`wait`)."""
        return math.inf

    def busy(self, result: int) -> bool:
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


_SUCCEEDED = OutcomeKind.SUCCEEDED
MAX_REFUSAL_CHARS = 4000  # as a task's error (aioq.worker.consumer.MAX_ERROR_CHARS)


def _kept_result(outcome: Outcome) -> str | None:
    """The return value to keep: a completion's, when its task keeps results or it is a
    workflow step (its dependents read it)."""
    if outcome.kind is not OutcomeKind.SUCCEEDED:
        return None
    if outcome.result_ttl is None and outcome.claim.workflow_id is None:
        return None
    return outcome.result if outcome.result is not None else "null"


def _refusal(outcome: Outcome, refused: BaseException) -> str:
    """The ``last_error`` of a job whose outcome the server refused: what it refused, why."""
    reason = f"{type(refused).__qualname__}: {refused}".replace("\x00", "\\x00")
    reason = reason.encode("utf-8", "backslashreplace").decode("utf-8")
    return (
        f"OutcomeRefused: the database refused to record this attempt's outcome"
        f" ({outcome.kind.value}): {reason}"
    )[:MAX_REFUSAL_CHARS]


def _extra(claim: Claim, outcome: str, duration: float) -> dict[str, object]:
    return {
        "job_id": claim.id,
        "task": claim.task,
        "queue": claim.queue,
        "attempt": claim.attempt,
        "duration_s": round(duration, 6),
        "outcome": outcome,
    }
