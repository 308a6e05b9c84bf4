"""Claim-ahead: jobs claimed beyond the free consumers wait under the heartbeat, released on a stop."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import asyncpg
import pytest
from waits import until_sql

import aioq
from aioq.errors import ConfigError

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0


async def test_prefetched_jobs_keep_their_lease_and_run_once(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    runs: list[tuple[int, int]] = []

    # Each run outlasts the lease, so a prefetched job waits longer than its lease: only the
    # heartbeat keeps the reapers of both workers from handing it to the other one.
    @registry.task(lease=1.0)
    async def slow() -> None:
        job = aioq.current_job()
        runs.append((job.id, job.attempt))
        await anyio.sleep(1.6)

    ids = [await slow.defer(conn) for _ in range(4)]
    options = {
        "concurrency": 1,
        "prefetch": 1,
        "heartbeat_interval": 0.2,
        "reaper_interval": 0.2,
    }
    async with make_worker(**options), make_worker(**options):
        with anyio.fail_after(HANG_GUARD):
            await until_sql(conn, "SELECT NOT EXISTS (SELECT FROM aioq.jobs)")
    assert sorted(runs) == [(job_id, 1) for job_id in ids]


@pytest.mark.parametrize("how", ["stop", "hard cancel"])
async def test_a_stopping_worker_releases_its_prefetched_jobs(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    how: str,
) -> None:
    started = anyio.Event()

    @registry.task
    async def hold() -> None:
        started.set()
        await anyio.sleep_forever()

    worker = make_worker(concurrency=1, prefetch=2, shutdown_grace=0.2)
    ids = [await hold.defer(conn) for _ in range(3)]
    mine = "SELECT count(*) FROM aioq.jobs WHERE status = 'running' AND locked_by = $1"
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            await started.wait()
            await until_sql(conn, f"SELECT ({mine}) >= 3", worker.id)  # one running, two ahead
            if how == "stop":
                worker.stop()
            else:
                tg.cancel_scope.cancel()
    rows = await conn.fetch("SELECT id, status, locked_by, attempts FROM aioq.jobs ORDER BY id")
    assert [tuple(r) for r in rows] == [(job_id, "pending", None, 0) for job_id in ids]


def test_prefetch_is_validated() -> None:
    with pytest.raises(ConfigError, match="prefetch"):
        aioq.WorkerConfig(prefetch=-1)
    assert aioq.WorkerConfig(prefetch=0).prefetch == 0
