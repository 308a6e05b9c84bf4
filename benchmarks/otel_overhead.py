"""What tracing costs: defer and drain with aioq.contrib.otel off, on without a provider, and on.

Three modes, interleaved over several rounds on one throwaway server (medians reported):
``off`` (instrument() never called: the hooks list is empty), ``unconfigured`` (instrument()
with OpenTelemetry's default proxy provider: nothing recorded, nothing stored) and ``sdk``
(a real SDK provider exporting to memory). Run: ``.venv/bin/python benchmarks/otel_overhead.py``
(AIOQ_DSN to use a server of your own).
"""

from __future__ import annotations

import os
import statistics
import time
import timeit
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aioq
import anyio
import asyncpg
from aioq import hooks
from aioq.contrib import otel
from aioq.dev.server import EmbeddedPostgres
from aioq.job import Claim
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

DEFERS = 200  # per round; the modes take turns round after round (a noisy machine drifts)
DEFER_ROUNDS = 30
JOBS = 1000
ROUNDS = 5

registry = aioq.Registry()


@registry.task
async def noop(n: int) -> None:
    """Do nothing: the queue's own cost is what is measured."""


@asynccontextmanager
async def database() -> AsyncIterator[str]:
    if dsn := os.environ.get("AIOQ_DSN"):
        yield dsn
        return
    async with EmbeddedPostgres(fsync=False) as server:
        yield server.dsn


def set_mode(mode: str, provider: TracerProvider) -> None:
    otel.uninstrument()
    if mode == "unconfigured":
        otel.instrument()
    elif mode == "sdk":
        otel.instrument(tracer_provider=provider)


async def defer_seconds(conn: asyncpg.Connection) -> float:
    """Seconds per defer, each in its own implicit transaction."""
    started = time.perf_counter()
    for n in range(DEFERS):
        await noop.defer(conn, n=n)
    return (time.perf_counter() - started) / DEFERS


async def drain_rate(dsn: str, conn: asyncpg.Connection) -> float:
    """Jobs per second one worker (concurrency 10) drains from a backlog of JOBS."""
    await noop.defer_many(conn, [{"n": n} for n in range(JOBS)])
    worker = aioq.Worker(dsn=dsn, registry=registry, concurrency=10, poll_interval=0.05)
    started = time.perf_counter()
    await worker.run_until_idle()
    return JOBS / (time.perf_counter() - started)


async def main() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    modes = ("off", "unconfigured", "sdk")
    defer: dict[str, list[float]] = {m: [] for m in modes}
    drain: dict[str, list[float]] = {m: [] for m in modes}
    async with database() as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("DROP SCHEMA IF EXISTS aioq CASCADE")
            await aioq.install(conn)
            for _ in range(DEFER_ROUNDS):
                for mode in modes:
                    set_mode(mode, provider)
                    defer[mode].append(await defer_seconds(conn))
                    memory.clear()
            await conn.execute("TRUNCATE aioq.jobs")
            for _ in range(ROUNDS):
                for mode in modes:
                    set_mode(mode, provider)
                    drain[mode].append(await drain_rate(dsn, conn))
                    memory.clear()
        finally:
            otel.uninstrument()
            await conn.close()
    print(f"{'mode':<14}{'defer µs (median)':>20}{'drain jobs/s (median)':>24}{'hooks µs/job':>14}")
    for mode in modes:
        us = statistics.median(defer[mode]) * 1e6
        rate = statistics.median(drain[mode])
        set_mode(mode, provider)
        print(f"{mode:<14}{us:>20.1f}{rate:>24.0f}{hook_cost():>14.2f}")
    otel.uninstrument()


def hook_cost() -> float:
    """Microseconds of Python the four hook points add per job, without the database."""
    claim = Claim(
        id=1,
        queue="q",
        task="t",
        args="{}",
        priority=0,
        attempt=1,
        max_attempts=5,
        lease=30.0,
        waited=0.0,
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
    )

    def one_job() -> None:
        if hooks.observers:
            deferral = hooks.Deferral("t", "q", 1)
            with hooks.deferring(deferral):
                pass
            hooks.claimed("w", [claim], 0, 1)
            with hooks.running("w", claim):
                pass
            hooks.settled("w", "succeeded", [(claim, None)], 0, 1)

    n = 20_000
    return timeit.timeit(one_job, number=n) / n * 1e6


if __name__ == "__main__":
    anyio.run(main)
