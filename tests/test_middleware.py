"""Middleware around every run, and the worker's lifespan (resources opened once per run)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from procs import LISTENERS, aioq_cli, assert_one_line_error
from waits import eventually

import aioq
from aioq.errors import ConfigError, StartupError
from aioq.testing import job_context

pytestmark = pytest.mark.anyio
MakeWorker = Callable[..., aioq.Worker]
CallNext = Callable[[], Awaitable[Any]]


@dataclass
class State:
    opened: int = 0
    closed: int = 0


async def test_middleware_wraps_async_and_sync_runs_in_order(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    seen: list[tuple[str, str, int, str]] = []

    def recorder(name: str) -> Callable[[aioq.JobContext, CallNext], Awaitable[Any]]:
        async def mw(job: aioq.JobContext, call_next: CallNext) -> Any:
            # Middleware runs in the event loop, around a sync task's thread too.
            assert threading.current_thread() is threading.main_thread()
            seen.append((name, "before", job.id, job.task))
            value = await call_next()
            seen.append((name, "after", job.id, job.task))
            return value

        return mw

    registry.middleware = (recorder("registry"),)

    @registry.task(name="a")
    async def a() -> None:
        seen.append(("task", "async", aioq.current_job().id, "a"))

    @registry.task(name="s")
    def s() -> None:
        assert threading.current_thread() is not threading.main_thread()
        seen.append(("task", "sync", aioq.current_job().id, "s"))

    job_a = await a.defer(conn)
    await make_worker(middleware=[recorder("worker")], concurrency=1).run_until_idle()
    job_s = await s.defer(conn)
    await make_worker(middleware=[recorder("worker")], concurrency=1).run_until_idle()
    assert seen == [
        ("registry", "before", job_a, "a"),
        ("worker", "before", job_a, "a"),
        ("task", "async", job_a, "a"),
        ("worker", "after", job_a, "a"),
        ("registry", "after", job_a, "a"),
        ("registry", "before", job_s, "s"),
        ("worker", "before", job_s, "s"),
        ("task", "sync", job_s, "s"),
        ("worker", "after", job_s, "s"),
        ("registry", "after", job_s, "s"),
    ]
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0


async def test_middleware_changes_the_outcome_by_raising_or_returning(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    async def gate(job: aioq.JobContext, call_next: CallNext) -> Any:
        if job.task == "refused":
            raise aioq.Fail("refused by middleware")  # the task never runs
        try:
            value = await call_next()
        except KeyError:
            return "recovered"  # a failure turned into a success with this value
        return value * 2 if isinstance(value, int) else value

    ran: list[str] = []

    @registry.task(name="refused")
    async def refused() -> None:
        ran.append("refused")

    @registry.task(name="double", result_ttl=60)
    def double() -> int:
        return 21

    @registry.task(name="flaky", result_ttl=60)
    async def flaky() -> str:
        raise KeyError("x")

    ids = [await refused.defer(conn), await double.defer(conn), await flaky.defer(conn)]
    await make_worker(middleware=[gate]).run_until_idle()
    assert ran == []
    row = await conn.fetchrow("SELECT status, last_error FROM aioq.jobs WHERE id = $1", ids[0])
    assert row["status"] == "dead"
    assert row["last_error"].startswith("Fail: refused by middleware")
    assert await aioq.result(conn, ids[1]) == 42
    assert await aioq.result(conn, ids[2]) == "recovered"


async def test_lifespan_opens_before_the_first_claim_and_closes_after_the_last_outcome(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(worker: aioq.Worker) -> AsyncIterator[State]:
        db = await asyncpg.connect(dsn)
        try:
            running = "SELECT count(*) FROM aioq.jobs WHERE status = 'running'"
            events.append(f"open: {await db.fetchval(running)} running, worker {worker.id}")
            state = State(opened=1)
            yield state
            state.closed += 1
            # Every outcome is written, every claim released before this runs.
            left = await db.fetchval("SELECT count(*) FROM aioq.jobs WHERE locked_by IS NOT NULL")
            events.append(f"close: {left} held")
        finally:
            await db.close()

    registry.lifespan = lifespan
    states: list[State] = []

    @registry.task(name="use")
    async def use(n: int) -> None:
        state = aioq.current_job().state_as(State)
        states.append(state)

    @registry.task(name="use_sync")
    def use_sync() -> None:
        states.append(aioq.current_job().state)

    for n in range(5):
        await use.defer(conn, n)
    await use_sync.defer(conn)
    worker = make_worker()
    await worker.run_until_idle()
    assert events == [f"open: 0 running, worker {worker.id}", "close: 0 held"]
    assert len(states) == 6
    assert all(s is states[0] for s in states)
    assert states[0].closed == 1
    # The worker's own lifespan replaces the registry's.
    await use_sync.defer(conn)
    other = object()

    @contextlib.asynccontextmanager
    async def mine(worker: aioq.Worker) -> AsyncIterator[object]:
        yield other

    await make_worker(lifespan=mine).run_until_idle()
    assert states[-1] is other


async def test_a_lifespan_that_fails_to_open_stops_the_worker_before_any_claim(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @contextlib.asynccontextmanager
    async def broken(worker: aioq.Worker) -> AsyncIterator[None]:
        raise ConnectionRefusedError("s3 is down")
        yield

    @registry.task(name="t")
    async def t() -> None: ...

    job = await t.defer(conn)
    with pytest.raises(StartupError, match="lifespan failed to open: ConnectionRefusedError: s3"):
        await make_worker(lifespan=broken).run_until_idle()
    row = await conn.fetchrow("SELECT status, attempts FROM aioq.jobs WHERE id = $1", job)
    assert tuple(row) == ("pending", 0)
    with pytest.raises(StartupError):
        async with make_worker(lifespan=broken):
            pass


async def test_no_job_context_has_state_without_a_lifespan_and_bad_values_are_refused(
    registry: aioq.Registry, dsn: str
) -> None:
    with job_context() as job:
        assert job.state is None
        with pytest.raises(aioq.AioqError, match="lifespan state is a NoneType, not a State"):
            job.state_as(State)

    def sync_mw(job: aioq.JobContext, call_next: CallNext) -> None: ...

    for bad in (sync_mw, [sync_mw], "mw", [1]):
        with pytest.raises(ConfigError, match="middleware"):
            aioq.Worker(dsn=dsn, registry=registry, middleware=bad)
    with pytest.raises(ConfigError, match="middleware"):
        aioq.Registry(middleware=[sync_mw])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="lifespan: must be a function"):
        aioq.Worker(dsn=dsn, registry=registry, lifespan="x")  # type: ignore[arg-type]


# --- worker processes ---

APP = textwrap.dedent(
    """
    import contextlib
    import os

    import anyio
    import asyncpg

    import aioq


    @contextlib.asynccontextmanager
    async def lifespan(worker):
        pool = await asyncpg.create_pool(os.environ["AIOQ_DSN"], min_size=1, max_size=2)
        await pool.execute("INSERT INTO life VALUES ($1, 'open', 0)", os.getpid())
        try:
            yield pool
        finally:
            held = await pool.fetchval(
                "SELECT count(*) FROM aioq.jobs WHERE locked_by = $1", worker.id
            )
            await pool.execute("INSERT INTO life VALUES ($1, 'close', $2)", os.getpid(), held)
            await pool.close()


    async def record(job, call_next):
        await job.state.execute("INSERT INTO seen VALUES ($1, $2)", job.id, os.getpid())
        return await call_next()


    registry = aioq.Registry(lifespan=lifespan, middleware=[record])


    @registry.task(name="nap", lease=1.0)
    async def nap() -> None:
        await anyio.sleep(0.05)
    """
)


def start(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with (cwd / "workers.log").open("ab") as log:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=log)


@pytest.fixture
def app(dsn: str, tmp_path: Path) -> Path:
    (tmp_path / "lifeapp.py").write_text(APP)
    return tmp_path


async def test_lifespan_and_middleware_across_processes_with_a_hard_kill(
    dsn: str, conn: asyncpg.Connection, app: Path
) -> None:
    """Two worker processes on 1 s leases; one is SIGKILLed mid-run. Every job runs through
    the middleware (at least once) and finishes; the survivor's lifespan opened once and,
    on SIGTERM, closes after its last outcome, holding no job."""
    await conn.execute("CREATE TABLE seen (job bigint, pid int)")
    await conn.execute("CREATE TABLE life (pid int, event text, held bigint)")
    await conn.execute(
        "INSERT INTO aioq.jobs (task, args) SELECT 'nap', '{}' FROM generate_series(1, 300)"
    )
    env = {**os.environ, "AIOQ_DSN": dsn}
    command = [sys.executable, "-m", "aioq", "worker", "lifeapp:registry", "--concurrency", "5"]
    procs = [start(command, app, env) for _ in "ab"]
    try:
        await eventually(lambda: _count(conn, LISTENERS, 2), "both workers to listen")
        await eventually(lambda: _at_least(conn, "SELECT count(*) FROM seen", 30))
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        await eventually(lambda: _count(conn, "SELECT count(*) FROM aioq.jobs", 0), "all done")
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert await conn.fetchval("SELECT count(DISTINCT job) FROM seen") == 300
    survivor = procs[1].pid
    life = await conn.fetch("SELECT event, held FROM life WHERE pid = $1", survivor)
    assert [tuple(r) for r in life] == [("open", 0), ("close", 0)]
    killed = await conn.fetch("SELECT event FROM life WHERE pid = $1", procs[0].pid)
    assert [r[0] for r in killed] == ["open"]  # SIGKILL: nothing closes, the leases expire


def test_cli_worker_with_a_failing_lifespan_exits_with_one_line(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "badlife.py").write_text(
        textwrap.dedent(
            """
            import contextlib

            import aioq


            @contextlib.asynccontextmanager
            async def lifespan(worker):
                raise RuntimeError("no credentials for the bucket")
                yield


            registry = aioq.Registry(lifespan=lifespan)


            @registry.task
            async def upload() -> None: ...
            """
        )
    )
    result = aioq_cli(dsn, "worker", "badlife:registry", cwd=tmp_path)
    message = assert_one_line_error(result, "lifespan failed to open", "no credentials")
    assert message.startswith("aioq: error: worker ")


async def _count(conn: asyncpg.Connection, query: str, n: int) -> bool:
    rows = await conn.fetch(query)
    found = len(rows) if query == LISTENERS else rows[0][0]
    return bool(found == n)


async def _at_least(conn: asyncpg.Connection, query: str, n: int) -> bool:
    return bool(await conn.fetchval(query) >= n)
