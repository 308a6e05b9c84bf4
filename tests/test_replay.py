"""Replaying dead jobs whose unique_key is shared or taken: one per key, the rest reported."""

from __future__ import annotations

import json
from collections.abc import Callable

import anyio
import asyncpg
import pytest
from db import run_sql
from procs import aioq_cli
from waits import until_sql

import aioq

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0
MakeWorker = Callable[..., aioq.Worker]


async def _statuses(conn: asyncpg.Connection) -> dict[int, str]:
    rows = await conn.fetch("SELECT id, status FROM aioq.jobs")
    return {row["id"]: row["status"] for row in rows}


async def test_retry_dead_replays_one_job_per_unique_key_and_reports_the_rest(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    failing = True
    ran: list[int] = []

    @registry.task(name="t.keyed", max_attempts=1)
    async def keyed(n: int) -> None:
        if failing:
            raise aioq.Fail(f"down {n}")
        ran.append(aioq.current_job().id)

    # Each job dies before the next with its key is deferred: dead jobs do not hold their key.
    dead: dict[str, list[int]] = {"k1": [], "k2": [], "k3": []}
    for key in ("k1", "k1", "k2", "k3"):
        dead[key].append(await keyed.options(unique_key=key).defer(conn, n=len(ran)))
        with anyio.fail_after(HANG_GUARD):
            await make_worker().run_until_idle()
    keyless = await keyed.defer(conn, n=9)
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()
    assert set((await _statuses(conn)).values()) == {"dead"}
    live = await keyed.options(unique_key="k3", delay=3600).defer(conn, n=10)

    async with conn.transaction():
        replay = await aioq.admin.replay(conn, all=True)
        # The caller's transaction is still usable after the replay.
        assert await conn.fetchval("SELECT 1") == 1

    older_k1, newer_k1 = dead["k1"]
    assert replay.replayed == sorted([newer_k1, dead["k2"][0], keyless])
    assert replay.skipped == {
        older_k1: f"unique_key 'k1' went to dead job {newer_k1}, the newest with that key",
        dead["k3"][0]: f"unique_key 'k3' is held by live job {live}",
    }
    statuses = await _statuses(conn)
    assert statuses[older_k1] == statuses[dead["k3"][0]] == "dead"
    assert statuses[live] == "pending"

    failing = False
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()
    assert sorted(ran) == replay.replayed

    # The key is free again once its replayed job finished: the older job can come back now.
    again = await aioq.admin.replay(conn, job_id=[older_k1, dead["k3"][0]])
    assert again.replayed == [older_k1]
    with pytest.warns(DeprecationWarning, match="Replay.retried is now Replay.replayed"):
        assert again.retried == [older_k1]  # the old name, for one release
    assert again.skipped == {dead["k3"][0]: f"unique_key 'k3' is held by live job {live}"}


async def test_retry_dead_skips_a_key_taken_by_a_defer_that_commits_during_the_replay(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(name="t.keyed")
    async def keyed() -> None:
        pass

    dead_id = await keyed.options(unique_key="k").defer(conn)
    await conn.execute("UPDATE aioq.jobs SET status = 'dead' WHERE id = $1", dead_id)
    other = await asyncpg.connect(dsn)
    try:
        tx = other.transaction()
        await tx.start()
        rival = await keyed.options(unique_key="k").defer(other)  # live, not committed yet
        result: list[aioq.admin.Replay] = []

        async def replay() -> None:
            result.append(await aioq.admin.replay(conn, job_id=dead_id))

        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                tg.start_soon(replay)
                # The replay's update waits on the rival's uncommitted index entry.
                await until_sql(
                    other,
                    "SELECT count(*) > 0 FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                await tx.commit()
    finally:
        await other.close()
    assert result == [aioq.admin.Replay(replayed=[], skipped={dead_id: f"unique_key 'k' is held by live job {rival}"})]  # fmt: skip
    assert (await _statuses(conn))[dead_id] == "dead"


def test_cli_jobs_replay_dead_replays_one_job_per_key(dsn: str) -> None:
    ids = [int(aioq_cli(dsn, "defer", "t").stdout) for _ in range(3)]
    run_sql(
        dsn,
        f"UPDATE aioq.jobs SET status = 'dead', unique_key = 'same' WHERE id IN ({ids[0]}, {ids[1]})",
        f"UPDATE aioq.jobs SET status = 'dead' WHERE id = {ids[2]}",
    )
    table = aioq_cli(dsn, "jobs", "replay", "--dead", "--json")
    assert table.returncode == 0, table
    assert json.loads(table.stdout) == {
        "replayed": [ids[1], ids[2]],
        "missing": [],
        "skipped": {
            str(ids[0]): f"unique_key 'same' went to dead job {ids[1]}, the newest with that key"
        },
    }
    # By id, the skipped job is reported, and the exit status says it was not replayed.
    by_id = aioq_cli(dsn, "jobs", "replay", str(ids[0]))
    assert by_id.returncode == 1, by_id
    assert by_id.stdout.splitlines() == [
        "replayed 0 jobs",
        f"skipped job {ids[0]}: unique_key 'same' is held by live job {ids[1]}",
    ]
