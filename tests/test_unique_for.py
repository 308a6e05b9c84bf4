"""Unique jobs over a window (unique_for) and on_conflict="replace"."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import anyio
import asyncpg
import pytest
import statements

import aioq
from aioq.errors import OptionError
from aioq.sql.maintenance import PRUNE_UNIQUES

pytestmark = pytest.mark.anyio
MakeWorker = Callable[..., aioq.Worker]


@pytest.fixture
def send(registry: aioq.Registry) -> aioq.Task[[int, str], None]:
    @registry.task(name="send")
    async def send(order_id: int, note: str = "") -> None: ...

    return send


async def jobs(conn: asyncpg.Connection) -> list[tuple[int, str, str]]:
    rows = await conn.fetch("SELECT id, status, args::text FROM aioq.jobs ORDER BY id")
    return [(r[0], r[1], r[2]) for r in rows]


async def test_a_defer_within_the_window_returns_the_first_job_even_once_it_finished(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None], make_worker: MakeWorker
) -> None:
    once = send.options(unique_key="invoice-7", unique_for=3600)
    first = await once.defer(conn, order_id=7)
    assert await once.defer(conn, order_id=8) == first  # live: as a plain unique_key
    await make_worker().run_until_idle()
    assert await jobs(conn) == []  # succeeded: the row is gone
    assert await once.defer(conn, order_id=9) == first  # still within the window
    assert await jobs(conn) == []
    # The window is the first job's: later defers do not extend it. Once it has passed, a
    # defer makes a new job and a new window.
    await conn.execute("UPDATE aioq.uniques SET expires_at = now() - interval '1 second'")
    second = await once.defer(conn, order_id=10)
    assert second != first
    assert [j[0] for j in await jobs(conn)] == [second]
    assert await once.defer(conn, order_id=11) == second
    # Other keys are their own.
    assert await send.options(unique_key="invoice-8", unique_for=60).defer(conn, 1) != second


async def test_a_dead_job_holds_its_window_too(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    once = send.options(unique_key="k", unique_for=timedelta(minutes=5))
    first = await once.defer(conn, order_id=1)
    await conn.execute("UPDATE aioq.jobs SET status = 'dead'")
    assert await once.defer(conn, order_id=1) == first
    # Without a window, a dead job frees its key (unchanged).
    assert await send.options(unique_key="k").defer(conn, order_id=1) != first


async def test_a_rolled_back_defer_leaves_no_window(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    once = send.options(unique_key="k", unique_for=60)
    tx = conn.transaction()
    await tx.start()
    rolled = await once.defer(conn, order_id=1)
    assert await once.defer(conn, order_id=1) == rolled  # its own transaction sees it
    await tx.rollback()
    kept = await once.defer(conn, order_id=1)
    assert kept != rolled
    assert await conn.fetchval("SELECT job_id FROM aioq.uniques") == kept


async def test_replace_updates_a_pending_jobs_arguments_and_run_time(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    debounce = send.options(unique_key="sync-42", on_conflict="replace", run_at=later)
    first = await debounce.defer(conn, order_id=1, note="first")
    even_later = later + timedelta(hours=1)
    again = send.options(unique_key="sync-42", on_conflict="replace", run_at=even_later)
    assert await again.defer(conn, order_id=2, note="second") == first
    row = await conn.fetchrow("SELECT args, run_at FROM aioq.jobs WHERE id = $1", first)
    assert json.loads(row["args"]) == {"order_id": 2, "note": "second"}
    assert row["run_at"] == even_later.replace(microsecond=row["run_at"].microsecond)
    # "keep" (the default) keeps them.
    assert await send.options(unique_key="sync-42").defer(conn, order_id=3) == first
    row = await conn.fetchrow("SELECT args FROM aioq.jobs WHERE id = $1", first)
    assert json.loads(row["args"])["order_id"] == 2
    # A running job is never changed: its run already started with its arguments.
    await conn.execute("UPDATE aioq.jobs SET run_at = now()")
    [claimed] = await statements.claim(conn, ["default"], 1, "worker-1")
    assert await again.defer(conn, order_id=4) == claimed.id == first
    row = await conn.fetchrow("SELECT args, status FROM aioq.jobs WHERE id = $1", first)
    assert (json.loads(row["args"])["order_id"], row["status"]) == (2, "running")
    # With a window, replace works on the live job the same way.
    both = send.options(unique_key="w", unique_for=60, on_conflict="replace")
    job = await both.defer(conn, order_id=1)
    assert await both.defer(conn, order_id=5) == job
    args = await conn.fetchval("SELECT args FROM aioq.jobs WHERE id = $1", job)
    assert json.loads(args)["order_id"] == 5


async def test_concurrent_defers_from_many_connections_make_one_job(
    dsn: str, conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    """32 connections defer one key at once, 20 rounds, each round on a fresh key and half of
    them after the previous job of the key finished: one job per key, every caller gets its id."""
    pool = await asyncpg.create_pool(dsn, min_size=32, max_size=32)
    made = 0
    try:
        for round_ in range(20):
            key = f"race-{round_ % 10}"  # rounds 10-19 reuse a key whose job is gone
            once = send.options(unique_key=key, unique_for=3600)
            got: list[int] = []

            async def defer(
                i: int, once: aioq.tasks.TaskCall[[int, str]] = once, got: list[int] = got
            ) -> None:
                async with pool.acquire() as c, c.transaction():
                    got.append(await once.defer(c, order_id=i))

            async with anyio.create_task_group() as tg:
                for i in range(32):
                    tg.start_soon(defer, i)
            assert len(set(got)) == 1, got
            made += await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE unique_key = $1", key)
            await conn.execute("DELETE FROM aioq.jobs")  # as if it succeeded
    finally:
        await pool.close()
    print(f"\n640 racing defers over 10 keys: {made} jobs made")
    assert made == 10
    assert await conn.fetchval("SELECT count(*) FROM aioq.uniques") == 10


async def test_ended_windows_are_pruned(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    for i in range(5):
        await send.options(unique_key=f"k{i}", unique_for=60).defer(conn, order_id=i)
    await conn.execute(
        "UPDATE aioq.uniques SET expires_at = now() - interval '1 second' WHERE key < 'k3'"
    )
    assert await PRUNE_UNIQUES.row(conn, "aioq", 2) == 2
    assert await PRUNE_UNIQUES.row(conn, "aioq", 100) == 1
    assert sorted(await conn.fetch("SELECT key FROM aioq.uniques")) == [("k3",), ("k4",)]


async def test_bad_values_are_refused_before_anything_is_written(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    for options, fragment in (
        ({"unique_for": 60}, "unique_for: needs a unique_key"),
        ({"unique_key": "k", "unique_for": 0}, "unique_for: must be finite, between 0.001"),
        ({"unique_key": "k", "unique_for": -5}, "unique_for"),
        ({"unique_key": "k", "unique_for": float("nan")}, "unique_for"),
        ({"unique_key": "k", "unique_for": "1h"}, "unique_for: must be seconds or a timedelta"),
        ({"on_conflict": "replace"}, "on_conflict: needs a unique_key"),
        ({"unique_key": "k", "on_conflict": "update"}, "must be 'keep' or 'replace'"),
    ):
        with pytest.raises(OptionError, match=fragment):
            send.options(**options)  # type: ignore[arg-type]
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0


async def test_jobs_without_a_key_never_touch_the_uniques_table(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    await send.defer(conn, order_id=1)
    await send.options(unique_key="k").defer(conn, order_id=1)
    await send.options(priority=3).defer(conn, order_id=1)
    assert await conn.fetchval("SELECT count(*) FROM aioq.uniques") == 0
    stats = await conn.fetchrow(
        "SELECT n_tup_ins + n_tup_upd + n_tup_del AS writes FROM pg_stat_xact_user_tables"
        " WHERE relname = 'uniques'"
    )
    assert stats is None or stats["writes"] == 0


def test_defer_sync_takes_the_window_replace_and_keys_too(
    dsn: str, registry: aioq.Registry
) -> None:
    """The synchronous defers write the same statements (psycopg here)."""
    import psycopg

    @registry.task(name="sync_send", concurrency_key=lambda order_id, **_: f"o{order_id}")
    async def sync_send(order_id: int, note: str = "") -> None: ...

    with psycopg.connect(dsn) as conn:
        once = sync_send.options(unique_key="k", unique_for=60, on_conflict="replace")
        first = once.defer_sync(conn, order_id=1)
        assert once.defer_sync(conn, order_id=2, note="new") == first
        ids = sync_send.defer_many_sync(conn, [{"order_id": 3}, {"order_id": 4}])
        conn.commit()
        rows = conn.execute(
            "SELECT id, args->>'order_id', concurrency_key FROM aioq.jobs ORDER BY id"
        ).fetchall()
        assert rows == [(first, "2", "o1"), (ids[0], "3", "o3"), (ids[1], "4", "o4")]
        conn.execute("DELETE FROM aioq.jobs")
        assert once.defer_sync(conn, order_id=5) == first  # the window outlives the job
