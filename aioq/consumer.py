"""Run one claimed job: resolve the task, decode and bind its arguments, run it, judge the outcome."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from aioq import hooks
from aioq.claims import CancelReason, Claims, Running
from aioq.codec import decode_args, encode_result
from aioq.completer import Completer, Outcome
from aioq.control import RunHandle
from aioq.errors import Fail, PayloadError, ResultError, Retry, UnknownTaskError
from aioq.job import Claim, JobContext, OutcomeKind, _current
from aioq.task import Backoff, Registry, Task

if TYPE_CHECKING:
    from aioq.producer import Handoff

__all__ = ("Consumer", "format_error")

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


@functools.cache
def _scope_class() -> type[anyio.CancelScope]:
    """The event loop's own CancelScope class, to make one scope per job directly.

    ``anyio.CancelScope()`` looks up the running backend on every call: per job, that lookup
    cost as much as the scope itself. aioq runs on asyncio only, so the class never changes.
    """
    return type(anyio.CancelScope())


def _failed(claim: Claim, retry: Backoff, ttl: float | None, started: float, error: str) -> Outcome:
    """The outcome of a failed attempt: retried after a backoff, or dead on its last attempt."""
    duration = time.monotonic() - started
    if claim.attempt >= claim.max_attempts:
        return Outcome(claim, OutcomeKind.BURY, duration, error=error, result_ttl=ttl)
    delay = retry.delay(claim.attempt)
    return Outcome(claim, OutcomeKind.FAIL, duration, delay=delay, error=error, result_ttl=ttl)


class Consumer:
    """One of the worker's N coroutines that run jobs."""

    def __init__(
        self,
        *,
        registry: Registry,
        worker_id: str,
        claims: Claims,
        limiter: anyio.CapacityLimiter,
        stopping: anyio.Event,
        completer: Completer,
    ) -> None:
        self.completer = completer
        self.registry = registry
        self.worker_id = worker_id
        self.claims = claims
        self.limiter = limiter
        self.stopping = stopping

    async def run(self, handoff: Handoff, on_done: Callable[[], None]) -> None:
        """Run claims from the handoff until it closes; call ``on_done`` after each."""
        while (claim := await handoff.get()) is not None:
            try:
                await self.handle(claim)
            finally:
                on_done()

    async def handle(self, claim: Claim) -> None:
        """Run one claim (or release it when stopping) and hand its outcome to the completer."""
        running = self.claims.get(claim)
        if running is None or running.cancel_reason is CancelReason.LEASE_LOST:
            self.completer.lost(claim)
            return
        if self.stopping.is_set():
            outcome: Outcome | None = Outcome(claim, OutcomeKind.RELEASE)
        else:
            outcome = await self.run_one(claim, running)
            # jobcontrol: once a cancel request reached the run, the job ends cancelled
            # whatever the task did next (a sync task returns when it sees the flag).
            if running.cancel_requested and outcome is not None:
                outcome = Outcome(
                    claim, OutcomeKind.CANCEL, outcome.duration, result_ttl=outcome.result_ttl
                )
        if outcome is None:
            self.completer.lost(claim)
        else:
            await self.completer.put(outcome)

    async def run_one(self, claim: Claim, running: Running) -> Outcome | None:
        """Run one attempt and return its outcome (None: lease lost); task faults never raise."""
        task = self.registry.get(claim.task)
        started = time.monotonic()
        if task is None:
            unknown = UnknownTaskError(
                claim.task, claim.id, f"no task named {claim.task!r} is registered in this worker"
            )
            error = format_error(unknown, with_traceback=False)
            return _failed(claim, _DEFAULT_RETRY, None, started, error)
        ttl = task.result_ttl  # jobcontrol: someone may await it
        try:
            kwargs = decode_args(claim.args)
            task.check_arguments(kwargs)
        except (ValueError, TypeError) as exc:
            err = PayloadError(
                claim.task, claim.id, f"cannot call {claim.task!r} with its stored arguments: {exc}"
            )
            return _failed(claim, task.retry, ttl, started, format_error(err, with_traceback=False))

        if running.cancel_requested:  # jobcontrol: cancelled before it started
            return Outcome(claim, OutcomeKind.CANCEL, result_ttl=ttl)
        # Built only if the task asks for it (current_job()): most never do.
        token = _current.set(functools.partial(self._context, claim, running))
        try:
            scope, returned, value = await self._call(task, kwargs, running)
        except Retry as exc:
            duration = time.monotonic() - started
            return Outcome(claim, OutcomeKind.SNOOZE, duration, delay=exc.delay, result_ttl=ttl)
        except Fail as exc:
            duration = time.monotonic() - started
            error = format_error(exc)
            return Outcome(claim, OutcomeKind.BURY, duration, error=error, result_ttl=ttl)
        except Exception as exc:
            return _failed(claim, task.retry, ttl, started, format_error(exc))
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise  # the worker's own cancellation (checked in _call)
            # SystemExit, KeyboardInterrupt, ... raised by the task's own code: a failure
            # like any other, never the end of the worker or of the batch-mates.
            return _failed(claim, task.retry, ttl, started, format_error(exc))
        finally:
            running.scope = None
            _current.reset(token)
        duration = time.monotonic() - started
        if running.cancel_requested:  # jobcontrol: handle() records it cancelled
            if running.cancel_reason is CancelReason.LEASE_LOST:
                return None  # the reaper wrote the requested cancel
            return Outcome(claim, OutcomeKind.CANCEL, duration, result_ttl=ttl)
        if not scope.cancelled_caught:
            if ttl is None:
                return Outcome(claim, OutcomeKind.COMPLETE, duration)
            try:  # jobcontrol: a value that cannot be stored fails the attempt
                result = encode_result(claim.task, claim.id, value)
            except ResultError as exc:
                error = format_error(exc, with_traceback=False)
                return _failed(claim, task.retry, ttl, started, error)
            return Outcome(claim, OutcomeKind.COMPLETE, duration, result_ttl=ttl, result=result)
        if running.cancel_reason is CancelReason.SHUTDOWN:
            # A thread that ran to its end after the stop: its work is done, record it.
            kind = OutcomeKind.COMPLETE if returned else OutcomeKind.RELEASE
            return Outcome(claim, kind, duration)
        if running.cancel_reason is not None:
            return None  # the lease is lost
        if returned:
            logger.warning(
                "job %s %s: its thread overstayed the %gs timeout (ran %.1fs); the job stayed"
                " claimed until it returned",
                claim.id,
                claim.task,
                task.timeout,
                duration,
            )
        error = f"TimeoutError: task {claim.task!r} timed out after {task.timeout:g}s"
        return _failed(claim, task.retry, ttl, started, error)

    def _context(self, claim: Claim, running: Running) -> JobContext:
        """What ``current_job()`` returns in the task; its handle reaches this run (jobcontrol)."""
        return JobContext(
            id=claim.id,
            attempt=claim.attempt,
            max_attempts=claim.max_attempts,
            task=claim.task,
            queue=claim.queue,
            worker_id=self.worker_id,
            snoozes=claim.snoozes,
            scheduled_at=claim.scheduled_at,
            handle=RunHandle(running, self.completer.store, self.completer.db, self.worker_id),
        )

    async def _call(
        self, task: Task[..., Any], kwargs: dict[str, Any], running: Running
    ) -> tuple[anyio.CancelScope, bool, object]:
        """Call the task under one scope; return the scope, whether a thread ran to its end,
        and the task's return value.

        The scope serves the timeout (its deadline), a lost lease and a shutdown (both set
        ``running.cancel_reason`` before they cancel it).
        """
        deadline = math.inf if task.timeout is None else anyio.current_time() + task.timeout
        returned = False
        value: object = None
        with _scope_class()(deadline=deadline) as scope:
            running.scope = scope
            if running.cancel_reason is not None:
                scope.cancel()
            try:
                # aioq.hooks: an observer (tracing) wraps the run and sees its exception.
                observed = (
                    hooks.running(self.worker_id, running.claim) if hooks.observers else _NO_HOOK
                )
                with observed:
                    if task.is_async:
                        value = await task.fn(**kwargs)
                    else:
                        # A thread cannot be interrupted: on timeout, a lost lease or shutdown
                        # the job stays claimed (the heartbeat extends it) until the thread
                        # returns; abandoning it would let a retry run beside it.
                        running.in_thread = True
                        try:
                            value = await anyio.to_thread.run_sync(
                                functools.partial(task.fn, **kwargs),
                                abandon_on_cancel=False,
                                limiter=self.limiter,
                            )
                        finally:
                            running.in_thread = False
                        returned = True
                        # A cancel that came while the thread ran lands here, inside the scope.
                        await anyio.lowlevel.checkpoint_if_cancelled()
            except asyncio.CancelledError as exc:
                if _cancel_requested():
                    raise
                # The task's own code raised it (it awaited a future cancelled elsewhere);
                # nobody cancelled us. Letting it escape would end the consumer's task group
                # and release the job, attempt refunded, forever.
                raise RuntimeError(
                    "the task raised CancelledError without being cancelled"
                ) from exc
        return scope, returned, value
