"""One live worker per worker id (docs/architecture.md, "Worker ids"): a worker whose id a live
one holds refuses to start, releasing nothing; a killed worker's id comes free for its
successor at once."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from procs import spawner
from waits import HANG_GUARD, until_sql

import aioq
from aioq.errors import WorkerIdInUse

pytestmark = pytest.mark.anyio

HOLDS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND application_name = $1"
)


async def test_a_second_worker_with_a_live_workers_id_refuses_and_releases_nothing(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    started = anyio.Event()
    go = anyio.Event()
    runs: list[int] = []

    @registry.task(name="long", lease=1)
    async def long() -> None:
        runs.append(1)
        started.set()
        await go.wait()

    job_id = await long.defer(conn)
    first = aioq.Worker(dsn=dsn, registry=registry, worker_id="w-1", heartbeat_interval=0.2)
    second = aioq.Worker(dsn=dsn, registry=registry, worker_id="w-1", poll_interval=0.05)
    with anyio.fail_after(HANG_GUARD):
        async with first:
            await started.wait()
            claimed = await conn.fetchrow(
                "SELECT status, claims, locked_by FROM aioq.jobs WHERE id = $1", job_id
            )
            with pytest.raises(WorkerIdInUse) as refused:
                await second.run()
            assert refused.value.worker_id == "w-1"
            assert "worker id 'w-1' is held by a live worker" in refused.value.message
            # Its job is untouched: the second worker released nothing under the id.
            again = await conn.fetchrow(
                "SELECT status, claims, locked_by FROM aioq.jobs WHERE id = $1", job_id
            )
            assert tuple(again) == tuple(claimed) == ("running", 1, "w-1")
            go.set()
        # Once the first has stopped, the id is free: the second starts.
        await long.defer(conn)
        await second.run_until_idle()
    assert len(runs) == 2
    assert await conn.fetchval(HOLDS, "aioq worker id w-1") == 0  # let go at the end

    # A generated id (host, pid, random) is unique by construction: no hold, no connection.
    @registry.task(name="t")
    async def t() -> int:
        return int(await conn.fetchval(HOLDS, f"aioq worker id {aioq.current_job().worker_id}"))

    seen: list[int] = []

    async def record(job: aioq.JobContext, call_next: Any) -> object:
        seen.append(await call_next())
        return seen[-1]

    await t.defer(conn)
    await aioq.Worker(dsn=dsn, registry=registry, middleware=[record]).run_until_idle()
    assert seen == [0]


TASKS = textwrap.dedent(
    """
    import asyncio
    import os

    import asyncpg

    import aioq

    registry = aioq.Registry()


    @registry.task(name="long", lease=1)
    async def long() -> None:
        conn = await asyncpg.connect(os.environ["AIOQ_DSN"])
        try:
            await conn.execute(
                "INSERT INTO runs (job_id, pid) VALUES ($1, $2)", aioq.current_job().id, os.getpid()
            )
        finally:
            await conn.close()
        await asyncio.sleep(3600)
    """
)


async def test_two_processes_with_one_id_the_second_refuses_and_a_killed_ones_successor_starts(
    dsn: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    (tmp_path / "idtasks.py").write_text(TASKS)
    await conn.execute("CREATE TABLE runs (job_id bigint, pid integer)")
    await conn.execute("INSERT INTO aioq.jobs (task) VALUES ('long')")
    args = ("worker", "idtasks", "--worker-id", "pod-0", "--poll-interval", "0.1")
    with spawner(dsn) as start:
        first = start(*args, cwd=tmp_path, output=subprocess.DEVNULL)
        await until_sql(conn, "SELECT count(*) = 1 FROM runs")
        second = start(*args, cwd=tmp_path)
        with anyio.fail_after(HANG_GUARD):
            while second.poll() is None:  # noqa: ASYNC110 (a process gives no event)
                await anyio.sleep(0.05)
        _, stderr = second.communicate()
        assert second.returncode == 2, stderr
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("aioq: error: worker id 'pod-0' is held by a live worker"), stderr
        assert "Traceback" not in stderr
        # The first worker's job was left alone: one run, still running under its claim.
        assert await conn.fetchval("SELECT count(*) FROM runs") == 1
        row = await conn.fetchrow("SELECT status, claims FROM aioq.jobs")
        assert tuple(row) == ("running", 1)
        assert first.poll() is None
        # SIGKILL: the id comes free as the server sees the connection gone. The successor
        # starts, releases the dead one's claim at once (no lease to wait for) and runs it.
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        successor = start(*args, cwd=tmp_path, output=subprocess.DEVNULL)
        await until_sql(conn, "SELECT count(*) = 2 FROM runs")
        pids = [r["pid"] for r in await conn.fetch("SELECT pid FROM runs ORDER BY pid")]
        assert successor.pid in pids
        assert successor.poll() is None
        successor.send_signal(signal.SIGTERM)
        try:
            successor.wait(HANG_GUARD)
        except subprocess.TimeoutExpired:
            pytest.fail("the successor did not stop on SIGTERM")
        assert successor.returncode == 0


async def run_under(conn: asyncpg.Connection, worker_id: str) -> int:
    """A row another worker runs under ``worker_id`` (its claim 7)."""
    return await conn.fetchval(
        "INSERT INTO aioq.jobs (task, status, claims, attempts, locked_by, locked_at,"
        " lease_expires_at, run_at) VALUES ('long', 'running', 7, 1, $1, now(),"
        " now() + interval '1 hour', now() + interval '1 hour') RETURNING id",
        worker_id,
    )


async def test_a_worker_whose_id_was_taken_while_its_hold_was_down_stops_releasing_only_its_own(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    """The hold's connection drops; before the worker takes its id again, another session
    (standing for a worker started meanwhile) takes it. The worker stops, releasing the claim it
    holds, fenced, and never the rows under the id that are not its own."""
    started = anyio.Event()

    @registry.task(name="long", lease=1)
    async def long() -> None:
        started.set()
        await anyio.sleep_forever()

    mine = await long.defer(conn)
    worker = aioq.Worker(
        dsn=dsn, registry=registry, worker_id="w-1", heartbeat_interval=0.5, shutdown_grace=0.2
    )
    other = await asyncpg.connect(dsn)
    ended = anyio.Event()
    try:
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    await worker.run()
                    ended.set()

                tg.start_soon(run)
                await started.wait()
                # Its hold's session ends; another session takes the id before the worker
                # takes it again (should the worker win the race, its new session ends too).
                while not await other.fetchval(
                    "SELECT pg_try_advisory_lock(hashtextextended('w-1',"
                    " 'aioq.jobs'::regclass::oid::bigint))"
                ):
                    await conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE application_name = 'aioq worker id w-1'"
                    )
                    await anyio.sleep(0.01)
                theirs = await run_under(conn, "w-1")  # the other worker's: not ours to release
                await ended.wait()
    finally:
        await other.close()
    rows = {
        r["id"]: tuple(r[1:])
        for r in await conn.fetch("SELECT id, status, claims, locked_by FROM aioq.jobs")
    }
    assert rows[mine] == ("pending", 1, None)  # its own claim, released fenced
    assert rows[theirs] == ("running", 7, "w-1")  # the other's, untouched
