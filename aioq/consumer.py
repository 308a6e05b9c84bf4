"""Run one claimed job: resolve the task, decode and bind its arguments, run it, judge the outcome."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from aioq.codec import decode_args, encode_result
from aioq.completer import LEASE_LOST, SHUTDOWN, Completer, Outcome, OutcomeKind, Running
from aioq.control import RunHandle
from aioq.errors import Fail, PayloadError, ResultError, Retry, UnknownTaskError
from aioq.job import Claim, JobContext, _current
from aioq.task import Backoff, Registry

if TYPE_CHECKING:
    from aioq.producer import Handoff

__all__ = ("Consumer", "format_error")

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 4000
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


class Consumer:
    """One of the worker's N coroutines that run jobs."""

    def __init__(
        self,
        *,
        registry: Registry,
        worker_id: str,
        in_flight: dict[int, Running],
        limiter: anyio.CapacityLimiter,
        stopping: anyio.Event,
        completer: Completer,
    ) -> None:
        self.completer = completer
        self.registry = registry
        self.worker_id = worker_id
        self.in_flight = in_flight
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
        running = self.in_flight[claim.id]
        if running.cancel_reason == LEASE_LOST:
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
        retry = task.retry if task is not None else _DEFAULT_RETRY
        ttl = task.result_ttl if task is not None else None  # jobcontrol: someone may await it
        started = time.monotonic()

        def failed(error: str) -> Outcome:
            duration = time.monotonic() - started
            if claim.attempt >= claim.max_attempts:
                return Outcome(claim, OutcomeKind.BURY, duration, error=error, result_ttl=ttl)
            return Outcome(
                claim, OutcomeKind.RETRY, duration, delay=retry.delay(claim.attempt), error=error
            )

        if task is None:
            unknown = UnknownTaskError(
                claim.task, claim.id, f"no task named {claim.task!r} is registered in this worker"
            )
            return failed(format_error(unknown, with_traceback=False))
        try:
            kwargs = decode_args(claim.args)
            task.check_arguments(kwargs)
        except (ValueError, TypeError) as exc:
            err = PayloadError(
                claim.task, claim.id, f"cannot call {claim.task!r} with its stored arguments: {exc}"
            )
            return failed(format_error(err, with_traceback=False))

        running.interruptible = task.is_async  # jobcontrol: a thread only sees the flag
        if running.cancel_requested:
            return Outcome(claim, OutcomeKind.CANCEL, result_ttl=ttl)  # not started yet
        token = _current.set(self._context(claim, running))
        # One scope serves the timeout (its deadline), a lost lease and a shutdown (both set
        # running.cancel_reason before they cancel it).
        deadline = math.inf if task.timeout is None else anyio.current_time() + task.timeout
        try:
            with anyio.CancelScope(deadline=deadline) as scope:
                running.scope = scope
                if running.cancel_reason is not None:
                    scope.cancel()
                try:
                    if task.is_async:
                        value = await task.fn(**kwargs)
                    else:
                        # A thread cannot be stopped: on timeout or cancellation it is
                        # abandoned and finishes in the background.
                        value = await anyio.to_thread.run_sync(
                            functools.partial(task.fn, **kwargs),
                            abandon_on_cancel=True,
                            limiter=self.limiter,
                        )
                except asyncio.CancelledError as exc:
                    if _cancel_requested():
                        raise
                    # The task's own code raised it (it awaited a future cancelled
                    # elsewhere); nobody cancelled us. Letting it escape would end the
                    # consumer's task group and release the job, attempt refunded, forever.
                    raise RuntimeError(
                        "the task raised CancelledError without being cancelled"
                    ) from exc
        except Retry as exc:
            duration = time.monotonic() - started
            return Outcome(claim, OutcomeKind.SNOOZE, duration, delay=exc.delay)
        except Fail as exc:
            duration = time.monotonic() - started
            return Outcome(
                claim, OutcomeKind.BURY, duration, error=format_error(exc), result_ttl=ttl
            )
        except Exception as exc:
            return failed(format_error(exc))
        finally:
            running.scope = None
            _current.reset(token)
        duration = time.monotonic() - started
        if scope.cancelled_caught and not running.cancel_requested:
            if running.cancel_reason == SHUTDOWN:
                return Outcome(claim, OutcomeKind.RELEASE, duration)
            if running.cancel_reason is not None:
                return None  # the lease is lost
            return failed(f"TimeoutError: task {claim.task!r} timed out after {task.timeout:g}s")
        if running.cancel_requested and running.cancel_reason == LEASE_LOST:
            return None  # the lease is lost: the reaper wrote the requested cancel
        if ttl is None or running.cancel_requested:
            return Outcome(claim, OutcomeKind.COMPLETE, duration, result_ttl=ttl)
        try:  # jobcontrol: the return value is kept as JSON; one that cannot be is a failure
            result = encode_result(claim.task, claim.id, value)
        except ResultError as exc:
            return failed(format_error(exc, with_traceback=False))
        return Outcome(claim, OutcomeKind.COMPLETE, duration, result_ttl=ttl, result=result)

    def _context(self, claim: Claim, running: Running) -> JobContext:
        """What ``current_job()`` returns in the task; its handle reaches this run (jobcontrol)."""
        return JobContext(
            id=claim.id,
            attempt=claim.attempt,
            max_attempts=claim.max_attempts,
            task=claim.task,
            queue=claim.queue,
            worker_id=self.worker_id,
            handle=RunHandle(running, self.completer.store, self.completer.db, self.worker_id),
        )
