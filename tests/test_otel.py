"""OpenTelemetry: one trace from an HTTP request through defer to the task's run, and no cost off."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import anyio
import asyncpg
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import aioq
import aioq.testing
from aioq.contrib import otel

pytestmark = pytest.mark.anyio

CLIENT_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Spans recorded through a provider of the test's own (the global one is never set)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    otel.instrument(tracer_provider=provider)
    yield memory
    otel.uninstrument()
    provider.shutdown()


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        found.setdefault(span.name, []).append(span)
    return found


def test_one_trace_from_an_http_request_through_defer_to_the_run(
    dsn: str, registry: aioq.Registry, exporter: InMemorySpanExporter
) -> None:
    provider_tracer = trace.get_tracer("app", tracer_provider=otel._installed[0].provider)

    @registry.task(queue="mail")
    async def welcome(user: str) -> None:
        with provider_tracer.start_as_current_span("render mail"):
            pass

    app = FastAPI()

    @app.post("/signup/{user}")
    async def signup(user: str, request: Request) -> dict[str, int]:
        # What an instrumented server does: continue the caller's trace in a SERVER span.
        parent = TraceContextTextMapPropagator().extract(dict(request.headers))
        with provider_tracer.start_as_current_span(
            "POST /signup/{user}", context=parent, kind=SpanKind.SERVER
        ):
            conn = await asyncpg.connect(dsn)
            try:
                async with conn.transaction():
                    job_id = await welcome.defer(conn, user=user)
            finally:
                await conn.close()
        return {"job_id": job_id}

    with TestClient(app) as client:
        response = client.post("/signup/ada", headers={"traceparent": CLIENT_TRACEPARENT})
    assert response.status_code == 200
    job_id = response.json()["job_id"]

    ran = anyio.run(aioq.testing.drain, dsn, registry)
    assert [(r.id, r.outcome) for r in ran] == [(job_id, "succeeded")]

    spans = by_name(exporter.get_finished_spans())
    [server] = spans["POST /signup/{user}"]
    [send] = spans["send mail"]
    [receive] = spans["receive mail"]
    [process] = spans["process mail"]
    [settle] = spans["settle mail"]
    [render] = spans["render mail"]
    trace_id = int(CLIENT_TRACEPARENT.split("-")[1], 16)
    for span in (server, send, receive, process, settle, render):
        assert span.context is not None
        assert span.context.trace_id == trace_id, span.name
    assert send.parent is not None
    assert server.context is not None
    assert send.parent.span_id == server.context.span_id
    for child in (receive, process, settle):
        assert child.parent is not None
        assert send.context is not None
        assert child.parent.span_id == send.context.span_id, child.name
    assert render.parent is not None
    assert process.context is not None
    assert render.parent.span_id == process.context.span_id
    kinds = {s.name: s.kind for s in (send, receive, process, settle)}
    assert kinds == {
        "send mail": SpanKind.PRODUCER,
        "receive mail": SpanKind.CONSUMER,
        "process mail": SpanKind.CONSUMER,
        "settle mail": SpanKind.CLIENT,
    }
    assert dict(send.attributes or {}) == {
        "messaging.system": "aioq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "defer",
        "messaging.destination.name": "mail",
        "messaging.message.id": str(job_id),
        "aioq.task": welcome.name,
    }
    attributes = dict(process.attributes or {})
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.message.id"] == str(job_id)
    assert attributes["aioq.attempt"] == 1
    assert process.status.status_code is StatusCode.UNSET
    assert dict(settle.attributes or {})["aioq.outcome"] == "succeeded"


async def test_a_failed_run_records_the_exception_and_a_timeout_is_marked_cancelled(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, exporter: InMemorySpanExporter
) -> None:
    @registry.task(max_attempts=1)
    async def broken() -> None:
        raise ValueError("no such user")

    @registry.task(timeout=0.05)
    async def slow() -> None:
        await anyio.sleep(30)

    await broken.defer(conn)
    await slow.defer(conn)
    ran = await aioq.testing.drain(dsn, registry)
    assert sorted(r.outcome for r in ran) == ["dead", "retried"]
    process = {
        dict(s.attributes or {})["aioq.task"]: s
        for s in exporter.get_finished_spans()
        if s.name == "process default"
    }
    failed = process[broken.name]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "ValueError: no such user"
    [event] = failed.events
    assert event.name == "exception"
    assert dict(event.attributes or {})["exception.type"] == "ValueError"
    assert dict(process[slow.name].attributes or {})["aioq.cancelled"] is True
    settled = {
        dict(s.attributes or {})["aioq.task"]: dict(s.attributes or {})["aioq.outcome"]
        for s in exporter.get_finished_spans()
        if s.name == "settle default"
    }
    assert settled == {broken.name: "dead", slow.name: "retried"}


async def test_each_job_keeps_its_own_trace_across_several_workers(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, exporter: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("test", tracer_provider=otel._installed[0].provider)

    @registry.task
    async def work(n: int) -> None:
        await anyio.sleep(0.01)

    traces: dict[int, int] = {}
    for n in range(12):
        with tracer.start_as_current_span(f"request {n}") as span:
            traces[await work.defer(conn, n=n)] = span.get_span_context().trace_id
    workers = [
        aioq.Worker(dsn=dsn, registry=registry, concurrency=3, poll_interval=0.05) for _ in range(3)
    ]
    async with anyio.create_task_group() as tg:
        for worker in workers:
            tg.start_soon(worker.run_until_idle)
    processed = [s for s in exporter.get_finished_spans() if s.name == "process default"]
    seen = {}
    for span in processed:
        job_id = int(dict(span.attributes or {})["messaging.message.id"])
        assert span.context is not None
        seen[job_id] = span.context.trace_id
    assert seen == traces
    assert len(processed) == len(traces)  # one run each


async def test_nothing_is_stored_or_recorded_without_a_configured_tracer(
    conn: asyncpg.Connection, registry: aioq.Registry, dsn: str
) -> None:
    @registry.task
    async def quiet() -> None:
        pass

    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    otel.instrument()  # the global provider: never configured in this test suite
    try:
        job_id = await quiet.defer(conn)
        await quiet.defer_many(conn, [{}, {}])
        assert await aioq.testing.drain(dsn, registry)
    finally:
        otel.uninstrument()
    assert not otel.is_instrumented()
    # Instrumented or not, with no provider no traceparent is written.
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE traceparent IS NOT NULL") == 0
    assert job_id


async def test_without_instrument_an_active_span_is_not_stored(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    provider = TracerProvider()

    @registry.task
    async def plain() -> None:
        pass

    with provider.get_tracer("t").start_as_current_span("request"):
        job_id = await plain.defer(conn)
    assert await conn.fetchval("SELECT traceparent FROM aioq.jobs WHERE id = $1", job_id) is None
    provider.shutdown()


async def test_the_traceparent_is_stored_with_the_job(
    conn: asyncpg.Connection, registry: aioq.Registry, exporter: InMemorySpanExporter
) -> None:
    @registry.task
    async def stored() -> None:
        pass

    ids = await stored.defer_many(conn, [{}, {}])
    rows = await conn.fetch("SELECT traceparent FROM aioq.jobs WHERE id = ANY($1)", ids)
    [send] = exporter.get_finished_spans()
    assert send.context is not None
    ctx = send.context
    expected = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    assert [row[0] for row in rows] == [expected, expected]
    assert dict(send.attributes or {})["messaging.batch.message_count"] == 2


def test_a_global_provider_set_after_instrument_is_picked_up(dsn: str) -> None:
    # In a process of its own: a global tracer provider, once set, cannot be unset.
    code = f"""
import anyio, asyncpg, aioq
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from aioq.contrib import otel

registry = aioq.Registry()

@registry.task
async def later() -> None: ...

async def main() -> None:
    otel.PROVIDER_CHECK_INTERVAL = 0.0
    otel.instrument()
    conn = await asyncpg.connect({dsn!r})
    await later.defer(conn)  # no provider yet: nothing stored
    trace.set_tracer_provider(TracerProvider())
    await later.defer(conn)
    print([r[0] is None for r in await conn.fetch("SELECT traceparent FROM aioq.jobs ORDER BY id")])

anyio.run(main)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[True, False]", out.stderr


async def test_a_workflow_is_one_send_span_and_every_step_carries_its_trace(
    conn: asyncpg.Connection, registry: aioq.Registry, exporter: InMemorySpanExporter
) -> None:
    @registry.task
    async def step(n: int) -> None:
        pass

    run = await aioq.group(step.call(n=1), step.call(n=2), then=step.call(n=3)).defer(conn)
    rows = await conn.fetch("SELECT traceparent FROM aioq.jobs WHERE workflow_id = $1", run.id)
    [send] = exporter.get_finished_spans()
    assert send.context is not None
    ctx = send.context
    expected = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    assert [row[0] for row in rows] == [expected] * 3
    attributes = dict(send.attributes or {})
    assert (attributes["aioq.task"], attributes["messaging.batch.message_count"]) == (
        "workflow group",
        3,
    )
