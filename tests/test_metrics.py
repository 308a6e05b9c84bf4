"""Prometheus metrics: values change as jobs run, scraped over HTTP; no import without them."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Callable

import anyio
import asyncpg
import pytest
import statements
from prometheus_client.parser import text_string_to_metric_families

import aioq
import aioq.metrics
from aioq.job import Claim, OutcomeKind
from aioq.metrics import Metrics
from aioq.worker.claims import Claims
from aioq.worker.completer import Completer, Outcome

pytestmark = pytest.mark.anyio

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_sync(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body: bytes = response.read()
    return body.decode()


async def scrape(port: int) -> Samples:
    """Fetch /metrics over HTTP and index every sample by name and labels."""
    text = await anyio.to_thread.run_sync(scrape_sync, port)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def test_metrics_change_as_jobs_run(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task
    async def ok(i: int) -> None: ...

    @registry.task(retry=aioq.Backoff(base=0, max=0))
    async def flaky() -> None:
        if aioq.current_job().attempt == 1:
            raise RuntimeError("first attempt fails")

    @registry.task(max_attempts=1)
    async def doomed() -> None:
        raise RuntimeError("always fails")

    metrics = Metrics(stats_interval=0.05)
    port = metrics.serve(0, "127.0.0.1")
    try:
        before = await scrape(port)
        assert value(before, "aioq_jobs_claimed_total", queue="default", task=ok.name) is None

        for i in range(3):
            await ok.defer(conn, i=i)
        await flaky.defer(conn)
        await doomed.defer(conn)
        await make_worker(metrics=metrics).run_until_idle()

        after = await scrape(port)
        q = "default"
        for name, task, expected in [
            ("aioq_jobs_claimed_total", ok.name, 3),
            ("aioq_jobs_claimed_total", flaky.name, 2),
            ("aioq_jobs_claimed_total", doomed.name, 1),
            ("aioq_jobs_succeeded_total", ok.name, 3),
            ("aioq_jobs_succeeded_total", flaky.name, 1),
            ("aioq_jobs_retried_total", flaky.name, 1),
            ("aioq_jobs_dead_total", doomed.name, 1),
        ]:
            assert value(after, name, queue=q, task=task) == expected, (name, task)
        assert value(after, "aioq_jobs_dead_total", queue=q, task=ok.name) is None
        assert value(after, "aioq_jobs_lease_lost_total", queue=q, task=ok.name) is None
        duration = "aioq_job_duration_seconds_count"
        assert value(after, duration, queue=q, task=ok.name, outcome="succeeded") == 3
        assert value(after, duration, queue=q, task=flaky.name, outcome="retried") == 1
        assert value(after, "aioq_job_queue_wait_seconds_count", queue=q) == 6
        claims = value(after, "aioq_claim_seconds_count")
        assert claims is not None
        assert claims >= 1

        # The gauges are sampled, not queried per scrape: wait for a sample showing the state
        # the worker left behind (only the dead job is still in the table).
        await ok.defer(conn, i=99)
        await ok.options(delay=3600).defer(conn, i=100)
        want = {"ready": 1.0, "scheduled": 1.0, "running": 0.0, "dead": 1.0}
        async with make_worker(metrics=metrics, queues=["other"]):
            with anyio.fail_after(10):
                while True:
                    gauges = await scrape(port)
                    got = {k: value(gauges, f"aioq_queue_{k}", queue=q) for k in want}
                    if got == want:
                        break
                    await anyio.sleep(0.02)
        age = value(gauges, "aioq_queue_oldest_ready_age_seconds", queue=q)
        assert age is not None
        assert 0 <= age < 3600
        assert value(gauges, "aioq_queue_expired", queue=q) == 0
    finally:
        metrics.close()


def held(*claims: Claim) -> Claims:
    tracked = Claims()
    tracked.add(claims)
    return tracked


async def test_lease_lost_is_counted(conn: asyncpg.Connection, registry: aioq.Registry) -> None:
    @registry.task
    async def work() -> None: ...

    job_id = await work.defer(conn)
    [claim] = await statements.claim(conn, ["default"], 1, "worker-a")
    # Another worker rescued the job: A's completion is fenced out.
    await conn.execute("UPDATE aioq.jobs SET locked_by = 'worker-b' WHERE id = $1", job_id)
    metrics = Metrics()
    completer = Completer(
        schema="aioq",
        db=conn,
        worker_id="worker-a",
        claims=held(claim),
        keep_completed=False,
        batch_size=10,
        max_pending=10,
    )
    completer.metrics = metrics
    completer.put(Outcome(claim, OutcomeKind.SUCCEEDED, 0.5))
    assert await completer.run_once() == 1
    lost = metrics.registry.get_sample_value(
        "aioq_jobs_lease_lost_total", {"queue": "default", "task": claim.task}
    )
    assert lost == 1
    succeeded = metrics.registry.get_sample_value(
        "aioq_jobs_succeeded_total", {"queue": "default", "task": claim.task}
    )
    assert succeeded is None


async def test_asgi_app_serves_the_registry() -> None:
    metrics = Metrics()
    metrics.claimed.labels("q", "t").inc(2)
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"", "headers": []}
    await metrics.asgi_app()(scope, receive, send)
    assert sent[0]["status"] == 200
    body = b"".join(m["body"] for m in sent if m["type"] == "http.response.body")  # type: ignore[misc]
    assert b'aioq_jobs_claimed_total{queue="q",task="t"} 2.0' in body


async def test_start_serves_on_a_port() -> None:
    metrics = aioq.metrics.start(0, "127.0.0.1")
    try:
        [port] = metrics.ports
        text = await anyio.to_thread.run_sync(scrape_sync, port)
        assert "# TYPE aioq_jobs_claimed_total counter" in text
        assert "process_cpu_seconds_total" in text
    finally:
        metrics.close()


def test_import_aioq_does_not_import_prometheus_client() -> None:
    code = (
        "import sys, aioq, aioq.metrics\n"
        "w = aioq.Worker(dsn='postgresql://unused')\n"
        "assert 'prometheus_client' not in sys.modules, 'imported'\n"
        "aioq.metrics.Metrics()\n"
        "assert 'prometheus_client' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
