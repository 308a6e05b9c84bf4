"""Run one claimed job: resolve the task, decode and bind its arguments, run it; then judge
what the run means for the job (:func:`judge`, no I/O) and hand that to the completer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from aioq import hooks
from aioq.backoff import Backoff
from aioq.codec import decode_args
from aioq.errors import Fail, PayloadError, ResultError, Retry, UnknownTaskError
from aioq.job import Claim, JobContext, OutcomeKind, _current, current_job
from aioq.registry import Middleware, Registry
from aioq.tasks import Task
from aioq.worker.claims import CancelReason, Claims, Running
from aioq.worker.completer import Completer, Outcome
from aioq.worker.control import RunHandle

if TYPE_CHECKING:
    from aioq.worker.claimer import Claimer
    from aioq.worker.producer import Handoff

__all__ = ("Attempt", "Consumer", "format_error", "judge")

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 4000
_NO_HOOK = contextlib.nullcontext()
_DEFAULT_RETRY = Backoff()


def format_error(exc: BaseException, *, with_traceback: bool = True) -> str:
    """Describe an exception as ``Type: message`` plus a bounded traceback."""
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not take the worker down
        message = "<str() failed>"
    head = _storable(f"{type(exc).__qualname__}: {message}")
    if not with_traceback or exc.__traceback__ is None:
        return head[:MAX_ERROR_CHARS]
    tb = _storable("".join(traceback.format_exception(exc)))
    room = MAX_ERROR_CHARS - len(head) - 1
    if room <= 0:
        return head[:MAX_ERROR_CHARS]
    if len(tb) > room:
        tb = "...\n" + tb[-(room - 4) :]
    return f"{head}\n{tb}"


def _storable(text: str) -> str:
    """Escape what a PostgreSQL text column refuses (NUL, lone surrogates)."""
    text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _cancel_requested() -> bool:
    """Whether this task is being cancelled (by a scope of ours or of a caller)."""
    current = asyncio.current_task()
    return current is None or current.cancelling() > 0


def _ours() -> bool:
    """Whether a cancel scope around this code is cancelled: the job's (its timeout, a lost
    lease, a shutdown, a cancel request) or the worker's (a stop's end, ``Worker.run()``
    cancelled from outside). A CancelledError with none of them cancelled is the task's own
    doing (docs/architecture.md, "Poison jobs")."""
    return anyio.current_effective_deadline() == -math.inf


def _cancelled_by_us(exc: BaseException) -> bool:
    """Whether ``exc`` is a cancellation that must end the consumer, not its job: ours, or one
    asked of this asyncio task from outside (its cancel count is up)."""
    return isinstance(exc, asyncio.CancelledError) and (_ours() or _cancel_requested())


def _escaped(exc: BaseException, step: str) -> str:
    """The ``last_error`` of an exception that escaped a step of running a job (not the task's
    own failure): the exception, the step it escaped from, its bounded traceback."""
    text = format_error(exc)
    head, newline, rest = text.partition("\n")
    return f"{head} (raised while {step}){newline}{rest}"[:MAX_ERROR_CHARS]


@functools.cache
def _scope_class() -> type[anyio.CancelScope]:
    """The event loop's own CancelScope class, to make one scope per job directly.

    ``anyio.CancelScope()`` looks up the running backend on every call: per job, that lookup
    cost as much as the scope itself. aioq runs on asyncio only, so the class never changes.
    """
    return type(anyio.CancelScope())


def _more_cancels(host: asyncio.Task[Any] | None, cancels: int) -> bool:
    """Whether ``host`` has more cancel requests than ``cancels``, its count before the run."""
    return host is not None and host.cancelling() > cancels


def _own_cancel(exc: asyncio.CancelledError, *, self_cancelled: bool) -> RuntimeError:
    """The failure recorded for a CancelledError the task brought on itself."""
    if self_cancelled:
        why = (
            "the task cancelled its own asyncio task (asyncio.current_task().cancel()); a job"
            " ends early by returning, raising, or aioq.Retry / aioq.Fail"
        )
    else:
        why = "the task raised CancelledError without being cancelled"
    error = RuntimeError(why)
    error.__cause__ = exc
    return error


async def _take_back_cancels(host: asyncio.Task[Any] | None, cancels: int) -> None:
    """Undo the cancel requests the task made of its own asyncio task (down to ``cancels``),
    and take the one still pending, if any, so that the consumer's next await does not get
    it. A cancellation of ours that arrives meanwhile propagates."""
    if host is None:
        return
    while host.cancelling() > cancels:
        host.uncancel()
    try:
        # A cancel requested while the task did not await is delivered at the next
        # suspension: here, rather than wherever the consumer waits next.
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        if _ours() or host.cancelling() > cancels:
            raise


class _NotStarted(Exception):
    """A plain def task's thread found, as it began, that the job's lease may have lapsed
    since the worker decided to start it: the task was not called."""


@dataclass(slots=True)
class Attempt:
    """How one call of a task went: what :func:`judge` decides the outcome from."""

    started: float  # time.monotonic() when the attempt began
    value: object = None  # what the task returned
    error: BaseException | None = None  # what the task raised (never a cancellation of ours)
    # Our scope stopped it (timeout, lost lease, shutdown, a cancel request); for a thread,
    # which cannot be stopped: the scope was cancelled while it ran.
    interrupted: bool = False
    returned: bool = False  # a plain def task's thread ran to its end

    @property
    def duration(self) -> float:
        """Seconds from the start of the attempt to now."""
        return time.monotonic() - self.started


def _failed(claim: Claim, retry: Backoff, ttl: float | None, started: float, error: str) -> Outcome:
    """The outcome of a failed attempt: retried after a backoff, or dead on its last attempt."""
    duration = time.monotonic() - started
    if claim.attempt >= claim.max_attempts:
        return Outcome(claim, OutcomeKind.DEAD, duration, error=error, result_ttl=ttl)
    delay = retry.delay(claim.attempt)
    return Outcome(claim, OutcomeKind.RETRIED, duration, delay=delay, error=error, result_ttl=ttl)


def judge(claim: Claim, task: Task[..., Any], running: Running, attempt: Attempt) -> Outcome | None:
    """Decide what one attempt means for its job (None: the lease is lost, write nothing).

    No I/O: :meth:`Consumer.handle` writes what this returns. A cancel request that reached the
    run turns any outcome into ``cancelled`` there.
    """
    ttl = task.result_ttl
    error = attempt.error
    if isinstance(error, Retry):
        return Outcome(
            claim, OutcomeKind.SNOOZED, attempt.duration, delay=error.delay, result_ttl=ttl
        )
    if isinstance(error, Fail):
        return Outcome(
            claim, OutcomeKind.DEAD, attempt.duration, error=format_error(error), result_ttl=ttl
        )
    if error is not None:
        # SystemExit, KeyboardInterrupt, ... raised by the task's own code too: a failure like
        # any other, never the end of the worker or of the batch-mates.
        if not task.retries(error):  # retry_on / no_retry_on: dead at once
            return Outcome(
                claim, OutcomeKind.DEAD, attempt.duration, error=format_error(error), result_ttl=ttl
            )
        return _failed(claim, task.retry, ttl, attempt.started, format_error(error))
    if running.cancel_requested:
        if running.cancel_reason is CancelReason.LEASE_LOST:
            return None  # the reaper wrote the requested cancel
        return Outcome(claim, OutcomeKind.CANCELLED, attempt.duration, result_ttl=ttl)
    if not attempt.interrupted:
        if ttl is None and claim.workflow_id is None:
            return Outcome(claim, OutcomeKind.SUCCEEDED, attempt.duration)
        try:  # a value that does not fit the annotation or cannot be stored fails the attempt
            result = task.codec.encode_result(claim.id, attempt.value)
        except ResultError as exc:
            return _failed(
                claim, task.retry, ttl, attempt.started, format_error(exc, with_traceback=False)
            )
        return Outcome(
            claim, OutcomeKind.SUCCEEDED, attempt.duration, result_ttl=ttl, result=result
        )
    if running.cancel_reason is CancelReason.SHUTDOWN:
        # A thread that ran to its end after the stop: its work is done, record it.
        kind = OutcomeKind.SUCCEEDED if attempt.returned else OutcomeKind.RELEASED
        return Outcome(claim, kind, attempt.duration)
    if running.cancel_reason is not None:
        return None  # the lease is lost
    if attempt.returned:
        logger.warning(
            "job %s %s: its thread overstayed the %gs timeout (ran %.1fs); the job stayed"
            " claimed until it returned",
            claim.id,
            claim.task,
            task.timeout,
            attempt.duration,
        )
    error_text = f"TimeoutError: task {claim.task!r} timed out after {task.timeout:g}s"
    if not task.retries(TimeoutError(error_text)):  # a timeout is a TimeoutError to retry_on
        return Outcome(claim, OutcomeKind.DEAD, attempt.duration, error=error_text, result_ttl=ttl)
    return _failed(claim, task.retry, ttl, attempt.started, error_text)


class Consumer:
    """Runs the jobs the producer hands over: the worker starts ``concurrency`` of its loops."""

    def __init__(
        self,
        *,
        registry: Registry,
        worker_id: str,
        claims: Claims,
        completer: Completer,
        stopping: anyio.Event,
        threads: anyio.CapacityLimiter,
        middleware: Sequence[Middleware] = (),
        state: object = None,
        unknown: Claimer | None = None,
    ) -> None:
        self.registry = registry
        # Learns the tasks this worker does not know, and how long their jobs may wait for a
        # worker that does (docs/architecture.md, "Unknown tasks"); none: 0, dead at once.
        self.unknown = unknown
        # Around every run, the first outermost (docs/architecture.md, "Middleware and
        # lifespan"); none: the task is called directly, as before.
        self.middleware = tuple(middleware)
        self.state = state  # what the worker's lifespan yielded: JobContext.state
        self.worker_id = worker_id
        self.claims = claims
        self.completer = completer
        self.stopping = stopping
        self.threads = threads

    async def run(self, handoff: Handoff, on_done: Callable[[], None]) -> None:
        """Run claims from the handoff until it closes; call ``on_done`` after each.

        Room for the outcome is awaited before a job is taken, never after it ran: a finished
        attempt's outcome is handed to the completer at once, whatever cancels the worker.
        """
        while True:
            await self.completer.wait_room()
            claim = await handoff.get()
            if claim is None:
                return
            try:
                await self.handle(claim)
            finally:
                on_done()

    async def handle(self, claim: Claim) -> None:
        """Run one claim (or give it back) and hand its outcome to the completer."""
        running = self.claims.get(claim)
        if running is None or running.cancel_reason is CancelReason.LEASE_LOST:
            self.completer.lost(claim)
            return
        if running.older is not None:
            # This worker claimed the job again while an earlier, lost claim of it still runs
            # here (a thread, or a run its cancel has not reached yet): one worker never runs
            # a job twice at once. The heartbeat keeps this claim meanwhile.
            older, running.older = running.older, None
            await older.ended()
            running = self.claims.get(claim)
            if running is None or running.cancel_reason is CancelReason.LEASE_LOST:
                self.completer.lost(claim)
                return
        if self.stopping.is_set():
            outcome: Outcome | None = Outcome(claim, OutcomeKind.RELEASED)
        elif running.lapsed(time.monotonic()):
            # It waited past its lease since the claim or the last beat (the event loop was
            # blocked): another worker may run it already. Never started; given back, fenced.
            logger.warning(
                "job %s %s: not started, its lease may have lapsed while it waited; released",
                claim.id,
                claim.task,
                extra={"job_id": claim.id, "task": claim.task, "queue": claim.queue},
            )
            outcome = Outcome(claim, OutcomeKind.RELEASED)
        else:
            started = time.monotonic()
            try:
                outcome = await self.run_one(claim, running)
            except BaseException as exc:
                # Whatever escapes the code that runs one job fails that job, never the
                # consumer (docs/architecture.md, "Poison jobs"); a cancellation of ours ends it.
                if _cancelled_by_us(exc):
                    raise
                outcome = self._failed_step(claim, None, started, exc, "running it")
            # Once a cancel request reached the run, the job ends cancelled whatever the task
            # did next (a sync task returns when it sees the flag).
            if running.cancel_requested and outcome is not None:
                outcome = Outcome(
                    claim, OutcomeKind.CANCELLED, outcome.duration, result_ttl=outcome.result_ttl
                )
        if outcome is None:
            self.completer.lost(claim)
        else:
            self.completer.put(outcome)

    async def run_one(self, claim: Claim, running: Running) -> Outcome | None:
        """Run one attempt and return its outcome (None: lease lost).

        Nothing but a cancellation of ours raises: whatever escapes a step (resolving the task,
        decoding its arguments, the middleware and the task, judging the attempt) fails this
        job, its attempt counted (docs/architecture.md, "Poison jobs").
        """
        started = time.monotonic()
        try:
            task = self.registry.get(claim.task)
        except BaseException as exc:
            if _cancelled_by_us(exc):
                raise
            return self._failed_step(claim, None, started, exc, "resolving its task")
        if task is None:
            return self._unknown(claim, started)
        step = "decoding its arguments"
        try:
            try:
                kwargs = decode_args(claim.args)
                task.check_arguments(kwargs)
            except (ValueError, TypeError) as exc:
                err = PayloadError(
                    claim.task,
                    claim.id,
                    f"cannot call {claim.task!r} with its stored arguments: {exc}",
                )
                error = format_error(err, with_traceback=False)
                return _failed(claim, task.retry, task.result_ttl, started, error)
            try:  # into the annotated types (docs/architecture.md, "Values")
                kwargs = task.codec.decode(kwargs, claim.id)
            except PayloadError as exc:
                # The stored value itself is wrong: no attempt can read it. Dead at once.
                error = format_error(exc, with_traceback=False)
                duration = time.monotonic() - started
                return Outcome(
                    claim, OutcomeKind.DEAD, duration, error=error, result_ttl=task.result_ttl
                )
            if running.cancel_requested:  # cancelled before it started
                return Outcome(claim, OutcomeKind.CANCELLED, result_ttl=task.result_ttl)
            step = "running it"
            # Built only if the task asks for it (current_job()): most never do.
            token = _current.set(functools.partial(self._context, claim, running))
            try:
                attempt = await self._call(task, kwargs, running, started)
            finally:
                running.end()
                _current.reset(token)
            if running.not_started:
                logger.warning(
                    "job %s %s: not started, its lease may have lapsed before its thread began;"
                    " released",
                    claim.id,
                    claim.task,
                    extra={"job_id": claim.id, "task": claim.task, "queue": claim.queue},
                )
                return Outcome(claim, OutcomeKind.RELEASED)
            step = "judging its outcome"
            return judge(claim, task, running, attempt)
        except BaseException as exc:
            if _cancelled_by_us(exc):
                raise
            return self._failed_step(claim, task, started, exc, step)

    def _unknown(self, claim: Claim, started: float) -> Outcome:
        """A job whose task this worker does not know (a deploy in progress): handed on to a
        worker that knows it, its attempt refunded and, from the first such claim, marked as
        waiting; this worker's claims skip it from now on. Once it has waited this worker's
        ``unknown_task_grace``, dead (docs/architecture.md, "Unknown tasks")."""
        grace = 0.0 if self.unknown is None else self.unknown.unknown_task_grace
        if self.unknown is not None and self.unknown.learn_unknown(claim.task):
            logger.warning(
                "task %r is not registered in this worker: its jobs wait for a worker that knows"
                " it, each up to unknown_task_grace (%gs) from when it was first found unknown",
                claim.task[:200],
                grace,
                extra={"task": claim.task, "queue": claim.queue},
            )
        waited = 0.0 if claim.unknown_for is None else claim.unknown_for
        duration = time.monotonic() - started
        if waited < grace:
            return Outcome(claim, OutcomeKind.UNKNOWN_TASK, duration)
        unknown = UnknownTaskError(
            claim.task,
            claim.id,
            f"no task named {claim.task!r} is registered in the workers that claimed this job,"
            f" and no worker that knows it took it within unknown_task_grace ({grace:g}s; it"
            f" waited {waited:.0f}s)",
        )
        error = format_error(unknown, with_traceback=False)
        return Outcome(claim, OutcomeKind.DEAD, duration, error=error)

    def _failed_step(
        self,
        claim: Claim,
        task: Task[..., Any] | None,
        started: float,
        exc: BaseException,
        step: str,
    ) -> Outcome:
        """The outcome of an attempt a step of aioq's (not the task) failed: a failed attempt,
        retried per the task's rules (the default backoff when the task is unknown), dead on
        the last one. A poison job ends dead, never given back for ever."""
        logger.warning(
            "job %s %s: %s raised %s; the attempt fails",
            claim.id,
            claim.task,
            step,
            type(exc).__qualname__,
            exc_info=exc,
            extra={"job_id": claim.id, "task": claim.task, "queue": claim.queue},
        )
        error = _escaped(exc, step)
        if task is None:
            return _failed(claim, _DEFAULT_RETRY, None, started, error)
        return _failed(claim, task.retry, task.result_ttl, started, error)

    def _context(self, claim: Claim, running: Running) -> JobContext:
        """What ``current_job()`` returns in the task; its handle reaches this run."""
        return JobContext(
            id=claim.id,
            attempt=claim.attempt,
            max_attempts=claim.max_attempts,
            task=claim.task,
            queue=claim.queue,
            worker_id=self.worker_id,
            snoozes=claim.snoozes,
            scheduled_at=claim.scheduled_at,
            handle=RunHandle(
                running, self.completer.schema, self.completer.db, self.worker_id, self.registry
            ),
            state=self.state,
        )

    async def _call(
        self, task: Task[..., Any], kwargs: dict[str, Any], running: Running, started: float
    ) -> Attempt:
        """Call the task under one scope, which serves the timeout (its deadline), a lost lease,
        a shutdown and a cancel request (each sets ``running.cancel_reason``, then cancels it).

        A cancellation of ours (that scope's, or one around the worker) ends the attempt as
        interrupted, or propagates; one the task made of its own asyncio task (its code called
        ``asyncio.current_task().cancel()``, or raised a CancelledError nobody asked for) fails
        the attempt, and is taken back so that the consumer goes on (docs/architecture.md,
        "Poison jobs").
        """
        deadline = math.inf if task.timeout is None else anyio.current_time() + task.timeout
        attempt = Attempt(started)
        host = asyncio.current_task()
        cancels = host.cancelling() if host is not None else 0
        scope = _scope_class()(deadline=deadline)
        cut = False  # our scope's cancel ended the run, though the scope did not absorb it
        try:
            with scope:
                running.scope = scope
                if running.cancel_reason is not None:
                    scope.cancel()
                try:
                    # aioq.hooks: an observer (tracing) wraps the run and sees its exception.
                    observed = (
                        hooks.running(self.worker_id, running.claim)
                        if hooks.observers
                        else _NO_HOOK
                    )
                    with observed:
                        if self.middleware:
                            attempt.value = await self._through_middleware(
                                task, kwargs, running, attempt
                            )
                        elif task.is_async:
                            attempt.value = await task.fn(**kwargs)
                        else:
                            attempt.value = await self._in_thread(task, kwargs, running)
                            attempt.returned = True
                except asyncio.CancelledError as exc:
                    if _ours():
                        raise  # the scope's (it ends here), or the worker's
                    # Nobody of ours cancelled it: the task cancelled its own asyncio task, or
                    # raised a CancelledError of its own. Letting it escape would end the
                    # consumer's task group and release the job, attempt refunded, for ever.
                    attempt.error = _own_cancel(exc, self_cancelled=_more_cancels(host, cancels))
                except BaseException as exc:
                    attempt.error = exc
                    if not self.middleware:  # with middleware, the task's own call says it
                        attempt.returned = not task.is_async
        except asyncio.CancelledError:
            # The job's scope was cancelled, but did not end the cancellation: the task had
            # cancelled its own asyncio task too (anyio leaves a native cancel alone). Ours
            # all the same, unless the worker's own scope is cancelled: then it propagates.
            if not scope.cancel_called or _ours():
                raise
            cut = True
        if _more_cancels(host, cancels) and not _ours():
            await _take_back_cancels(host, cancels)
        # A thread is never interrupted: whether the scope was cancelled while it ran is what
        # says the attempt overstayed (a timeout) or outlived its claim.
        attempt.interrupted = (
            cut or scope.cancelled_caught or (not task.is_async and scope.cancel_called)
        )
        return attempt

    async def _through_middleware(
        self, task: Task[..., Any], kwargs: dict[str, Any], running: Running, attempt: Attempt
    ) -> object:
        """Run the task inside the middleware chain, in the event loop (a sync task's thread is
        the innermost call); return what the outermost middleware returned."""

        async def call_task() -> object:
            if task.is_async:
                return await task.fn(**kwargs)
            try:
                value = await self._in_thread(task, kwargs, running)
            except asyncio.CancelledError:
                raise
            except BaseException:
                attempt.returned = True
                raise
            attempt.returned = True
            return value

        job = current_job()
        call: Callable[[], Awaitable[object]] = call_task
        for mw in reversed(self.middleware):
            call = functools.partial(mw, job, call)
        return await call()

    async def _in_thread(
        self, task: Task[..., Any], kwargs: dict[str, Any], running: Running
    ) -> object:
        """Run a plain def task in a thread and wait for it, whatever cancels the worker.

        A thread cannot be interrupted: on a timeout, a lost lease, a shutdown, or a cancel of
        the whole worker, the job stays claimed (the heartbeat extends it) until the thread
        returns, and its outcome is recorded; abandoning it would let a retry run beside it
        (docs/architecture.md, "Shutdown").
        """

        def start() -> object:
            # The thread begins after the event loop ran other tasks (the hand-off to the
            # thread and the limiter yield to it): one that blocked the loop then may have let
            # the lease lapse, and another worker may run the job already. Checked as the task
            # would begin, in its thread: never started, given back (docs/architecture.md,
            # "Leases").
            if running.lapsed(time.monotonic()) or running.cancel_reason is CancelReason.LEASE_LOST:
                running.not_started = True
                raise _NotStarted
            return task.fn(**kwargs)

        self.claims.enter_thread(running)
        try:
            return await anyio.to_thread.run_sync(
                start, abandon_on_cancel=False, limiter=self.threads
            )
        finally:
            self.claims.leave_thread(running)
