"""OpenTelemetry traces for aioq: ``pip install 'aioq-pg[otel]'``, then ``instrument()``.

With the instrumentation on and a tracer provider configured, a ``defer`` makes a PRODUCER span
(``send <queue>``) under whatever span is current (an HTTP request's, say) and stores its W3C
``traceparent`` with the job. The worker continues that trace: a CONSUMER span ``receive
<queue>`` for the claim, ``process <queue>`` for the run of the task (its exception recorded
when it fails; spans the task makes are its children), and a CLIENT span ``settle <queue>`` for
the write of the outcome. Attributes follow OpenTelemetry's messaging conventions
(``messaging.system`` = ``aioq``, ``messaging.operation.type``, ``messaging.destination.name``,
``messaging.message.id``, ...).

Opt-in, not automatic: OpenTelemetry's convention for library instrumentation is an explicit
``instrument()`` call, and the API package is often installed without anyone wanting aioq's
spans (other libraries depend on it). ``instrument()`` in the process that defers and in the
worker's (e.g. in the module that defines the tasks). Without a configured tracer provider
nothing is recorded and no traceparent is stored; without ``instrument()`` aioq never imports
OpenTelemetry at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from aioq import __version__, hooks
from aioq.errors import Retry
from aioq.job import Claim

__all__ = ("instrument", "is_instrumented", "uninstrument")

SYSTEM = "aioq"
PROVIDER_CHECK_INTERVAL = 1.0  # seconds between looks for a global provider set after instrument()
_PROPAGATOR = TraceContextTextMapPropagator()
_UNCONFIGURED = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


def _context(traceparent: str | None) -> Context | None:
    if traceparent is None:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


def _attributes(operation: str, name: str, queue: str, **more: Any) -> dict[str, Any]:
    attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": operation,
        "messaging.operation.name": name,
        "messaging.destination.name": queue,
    }
    attributes.update({k: v for k, v in more.items() if v is not None})
    return attributes


class _Tracing(hooks.Observer):
    """Spans for defer, claim, run and settle, on one tracer provider (or the global one)."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self.provider = provider
        self._tracer = None if provider is None else provider.get_tracer("aioq", __version__)
        self._next_check = 0.0

    def tracer(self) -> Tracer | None:
        """The tracer, or None while no provider is configured (then aioq records nothing)."""
        if self._tracer is not None:
            return self._tracer
        # Unconfigured, the global provider is looked up at most once a second: the lookup
        # reads the environment (2.5 µs), and a provider, once set, stays set.
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + PROVIDER_CHECK_INTERVAL
        provider = trace.get_tracer_provider()
        if isinstance(provider, _UNCONFIGURED):
            return None
        self._tracer = provider.get_tracer("aioq", __version__)
        return self._tracer

    def deferring(self, deferral: hooks.Deferral) -> AbstractContextManager[object]:
        tracer = self.tracer()
        if tracer is None:
            return _NOTHING
        return self._defer_span(tracer, deferral)

    @contextmanager
    def _defer_span(self, tracer: Tracer, deferral: hooks.Deferral) -> Iterator[None]:
        attributes = _attributes(
            "send",
            "defer",
            deferral.queue,
            **{"aioq.task": deferral.task},
            **{"messaging.batch.message_count": deferral.count if deferral.count > 1 else None},
        )
        with tracer.start_as_current_span(
            f"send {deferral.queue}", kind=SpanKind.PRODUCER, attributes=attributes
        ) as span:
            carrier: dict[str, str] = {}
            _PROPAGATOR.inject(carrier)  # the current span: the one just started
            deferral.traceparent = carrier.get("traceparent")
            yield
            if len(deferral.ids) == 1:
                span.set_attribute("messaging.message.id", str(deferral.ids[0]))

    def claimed(self, worker_id: str, claims: Sequence[Claim], start_ns: int, end_ns: int) -> None:
        tracer = self.tracer()
        if tracer is None:
            return
        for claim in claims:
            if claim.traceparent is None:
                continue  # deferred untraced: a span here would start a trace of its own
            span = tracer.start_span(
                f"receive {claim.queue}",
                context=_context(claim.traceparent),
                kind=SpanKind.CONSUMER,
                start_time=start_ns,
                attributes=_attributes(
                    "receive",
                    "claim",
                    claim.queue,
                    **_job_attributes(worker_id, claim),
                    **{"messaging.batch.message_count": len(claims)},
                ),
            )
            span.end(end_time=end_ns)

    def running(self, worker_id: str, claim: Claim) -> AbstractContextManager[object]:
        tracer = self.tracer()
        if tracer is None:
            return _NOTHING
        return self._run_span(tracer, worker_id, claim)

    @contextmanager
    def _run_span(self, tracer: Tracer, worker_id: str, claim: Claim) -> Iterator[None]:
        with tracer.start_as_current_span(
            f"process {claim.queue}",
            context=_context(claim.traceparent),
            kind=SpanKind.CONSUMER,
            attributes=_attributes(
                "process", "run", claim.queue, **_job_attributes(worker_id, claim)
            ),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield
            except Retry as exc:  # asked to run later: not an error
                span.add_event("aioq.retry", {"aioq.retry.delay_s": exc.delay})
                raise
            except Exception as exc:
                _failed(span, exc)
                raise
            except BaseException:
                # Cancelled: a timeout, a lost lease or a shutdown (the worker logs which).
                span.set_attribute("aioq.cancelled", True)
                raise

    def settled(
        self,
        worker_id: str,
        outcome: str,
        settled: Sequence[tuple[Claim, str | None]],
        start_ns: int,
        end_ns: int,
    ) -> None:
        tracer = self.tracer()
        if tracer is None:
            return
        for claim, _error in settled:
            if claim.traceparent is None:
                continue
            attributes = _attributes(
                "settle", outcome, claim.queue, **_job_attributes(worker_id, claim)
            )
            attributes["aioq.outcome"] = outcome
            span = tracer.start_span(
                f"settle {claim.queue}",
                context=_context(claim.traceparent),
                kind=SpanKind.CLIENT,
                start_time=start_ns,
                attributes=attributes,
            )
            span.end(end_time=end_ns)


def _job_attributes(worker_id: str, claim: Claim) -> dict[str, Any]:
    return {
        "messaging.message.id": str(claim.id),
        "messaging.client.id": worker_id,
        "aioq.task": claim.task,
        "aioq.attempt": claim.attempt,
    }


def _failed(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__qualname__}: {exc}"))
    span.set_attribute("error.type", type(exc).__qualname__)


_NOTHING: AbstractContextManager[object] = nullcontext()
_installed: list[_Tracing] = []


def instrument(tracer_provider: TracerProvider | None = None) -> None:
    """Trace defers, claims, runs and outcomes (on this provider, else the global one)."""
    uninstrument()
    observer = _Tracing(tracer_provider)
    hooks.install(observer)
    _installed.append(observer)


def uninstrument() -> None:
    """Stop tracing."""
    while _installed:
        hooks.uninstall(_installed.pop())


def is_instrumented() -> bool:
    """Whether ``instrument()`` is in effect."""
    return bool(_installed)
