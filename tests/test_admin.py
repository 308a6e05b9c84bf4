"""aioq.admin: every operation has a synchronous twin, and each twin answers as its async form.

The twins take a synchronous connection (psycopg here; psycopg 2, SQLAlchemy and Django run the
same statements through aioq.dbapi, tests/test_defer_sync.py and tests/test_django.py) and run
in its transaction: a twin that writes is committed by its caller.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import asyncpg
import psycopg
import pytest
from waits import HANG_GUARD, until_sql

import aioq
from aioq import admin
from aioq.db import Target
from aioq.dbapi import SyncTarget

pytestmark = pytest.mark.anyio

# Top-level reads of an application's own work, with their twins; install has none: it
# applies migrations under an advisory lock on an asyncpg connection (the sync path to a schema
# is the script `aioq schema sql` prints for a migration tool: admin.schema_sql).
TOP_LEVEL_TWINS = {"result", "workflow"}
NO_TWIN = {"install"}


def _operations(module: Any) -> set[str]:
    return {n for n in module.__all__ if inspect.iscoroutinefunction(getattr(module, n))}


def _assert_twins(module: Any, name: str) -> None:
    """The sync twin takes the same parameters (kinds, defaults, annotations) and returns the
    same type; only the connection's type differs."""
    op, twin = getattr(module, name), getattr(module, f"{name}_sync")
    assert not inspect.iscoroutinefunction(twin), name
    a, s = inspect.signature(op), inspect.signature(twin)
    assert list(a.parameters) == list(s.parameters), name
    (first, *rest) = a.parameters.values()
    (sync_first, *sync_rest) = s.parameters.values()
    assert (first.annotation, sync_first.annotation) == ("Target", "SyncTarget"), name
    assert first.kind == sync_first.kind, name
    assert [(p.kind, p.default, p.annotation) for p in rest] == [
        (p.kind, p.default, p.annotation) for p in sync_rest
    ], name
    assert a.return_annotation == s.return_annotation, name
    assert (twin.__doc__ or "").strip(), name


def test_every_admin_operation_has_a_sync_twin_with_the_same_parameters() -> None:
    operations = _operations(admin)
    assert operations == {
        "cancel_jobs",
        "cancel_workflow",
        "delete_jobs",
        "get_job",
        "list_jobs",
        "list_workflows",
        "purge_dead",
        "queues",
        "replay",
        "ring",
        "set_queue",
        "stats",
    }
    for name in sorted(operations):
        _assert_twins(admin, name)
    # And no twin without its operation.
    twins = {n for n in admin.__all__ if n.endswith("_sync")}
    assert twins == {f"{n}_sync" for n in operations}


def test_the_top_level_reads_have_sync_twins_too() -> None:
    assert _operations(aioq) == TOP_LEVEL_TWINS | NO_TWIN
    for name in sorted(TOP_LEVEL_TWINS):
        _assert_twins(aioq, name)
    assert {n for n in aioq.__all__ if n.endswith("_sync")} == {
        f"{n}_sync" for n in TOP_LEVEL_TWINS
    }


def test_the_twin_check_sees_a_drift() -> None:
    class Drifted:
        __all__ = ("op", "op_sync")

        @staticmethod
        async def op(conn: Target, job_id: int, *, reason: str | None = None) -> int:
            """An operation."""
            return job_id

        @staticmethod
        def op_sync(conn: SyncTarget, job_id: int) -> int:
            """Its twin, which lost ``reason``."""
            return job_id

    with pytest.raises(AssertionError):
        _assert_twins(Drifted, "op")


@pytest.fixture
def sync_conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A psycopg connection, not in autocommit: the twins run in its transaction."""
    with psycopg.connect(dsn) as conn:
        yield conn


def _bury(conn: asyncpg.Connection, *ids: int) -> Any:
    return conn.execute("UPDATE aioq.jobs SET status = 'dead' WHERE id = ANY($1)", list(ids))


async def test_get_job_and_list_jobs_sync_answer_as_the_async_forms(
    conn: asyncpg.Connection,
    sync_conn: psycopg.Connection[Any],
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    @registry.task(name="t.kept", result_ttl=60)
    async def kept(n: int) -> int:
        return n

    @registry.task(name="t.left", queue="other")
    async def left(n: int) -> None: ...

    done = await kept.defer(conn, n=7)
    await make_worker().run_until_idle()
    pending = await left.defer(conn, n=1)
    dead = await left.defer(conn, n=2)
    await _bury(conn, dead)
    for job_id in (done, pending, dead, 10**9, 2**63):
        assert admin.get_job_sync(sync_conn, job_id) == await admin.get_job(conn, job_id)
    assert admin.get_job_sync(sync_conn, done).result == "7"  # type: ignore[union-attr]
    for filters in (
        {},
        {"status": "pending"},
        {"status": "dead", "queue": "other"},
        {"status": "succeeded"},
        {"task": "t.left", "limit": 1},
    ):
        found = admin.list_jobs_sync(sync_conn, **filters)
        assert found == await admin.list_jobs(conn, **filters), filters
        assert found, filters


async def test_cancel_jobs_sync_records_its_reason_as_cancel_jobs_does(
    conn: asyncpg.Connection, sync_conn: psycopg.Connection[Any], registry: aioq.Registry
) -> None:
    @registry.task(name="t.c")
    async def c() -> None: ...

    a, b = await c.defer(conn), await c.defer(conn)
    assert admin.cancel_jobs_sync(sync_conn, [a, 10**9], reason="not needed") == {
        a: "cancelled",
        10**9: "missing",
    }
    sync_conn.commit()
    assert await admin.cancel_jobs(conn, [b, 10**9], reason="not needed") == {
        b: "cancelled",
        10**9: "missing",
    }
    assert admin.cancel_jobs_sync(sync_conn, [a, b]) == {a: "cancelled", b: "cancelled"}
    for job_id in (a, b):
        job = await admin.get_job(conn, job_id)
        assert job is not None
        assert (job.status, job.last_error) == ("cancelled", "not needed")


async def test_replay_delete_and_purge_sync_answer_as_the_async_forms(
    conn: asyncpg.Connection, sync_conn: psycopg.Connection[Any], registry: aioq.Registry
) -> None:
    @registry.task(name="t.r")
    async def r() -> None: ...

    keyed = [await r.options(unique_key="k").defer(conn) for _ in range(2)]  # one live job
    await _bury(conn, keyed[0])
    second = await r.options(unique_key="k").defer(conn)
    await _bury(conn, keyed[0], second)
    one, two = await r.defer(conn), await r.defer(conn)
    await _bury(conn, one, two)

    replayed = admin.replay_sync(sync_conn, job_id=[keyed[0], second, one])
    sync_conn.commit()
    assert replayed == admin.Replay(
        replayed=[second, one],
        skipped={keyed[0]: f"unique_key 'k' went to dead job {second}, the newest with that key"},
    )
    assert await admin.replay(conn, job_id=two) == admin.Replay(replayed=[two], skipped={})
    with pytest.raises(ValueError, match="replay needs job_id, task, queue or all=True"):
        admin.replay_sync(sync_conn)

    assert admin.delete_jobs_sync(sync_conn, [one, 10**9, 2**63]) == [one]
    sync_conn.commit()
    assert await admin.delete_jobs(conn, [two, one]) == [two]
    await _bury(conn, second)
    assert admin.purge_dead_sync(sync_conn, batch_size=1) == 2  # keyed[0] and second
    sync_conn.commit()
    assert await admin.purge_dead(conn) == 0
    with pytest.raises(aioq.errors.ConfigError):
        admin.purge_dead_sync(sync_conn, older_than=float("inf"))


@pytest.mark.parametrize("autocommit", [False, True], ids=["in a transaction", "autocommit"])
async def test_replay_sync_keeps_the_caller_s_transaction_usable_when_it_loses_a_race(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry, autocommit: bool
) -> None:
    # As tests/test_replay.py's race for replay(): a defer of the key commits while the
    # replay's statement waits on its uncommitted entry, and the statement fails with a unique
    # violation. In the caller's transaction, a savepoint rolls back that try alone; in
    # autocommit, the try was a transaction of its own.
    @registry.task(name="t.keyed")
    async def keyed() -> None: ...

    dead_id = await keyed.options(unique_key="k").defer(conn)
    await _bury(conn, dead_id)
    result: list[admin.Replay] = []
    other = await asyncpg.connect(dsn)
    try:
        tx = other.transaction()
        await tx.start()
        rival = await keyed.options(unique_key="k").defer(other)  # live, not committed yet
        with psycopg.connect(dsn, autocommit=autocommit) as sync:

            def replay() -> None:
                result.append(admin.replay_sync(sync, job_id=dead_id))
                assert sync.execute("SELECT 1").fetchall() == [(1,)]  # still usable
                sync.commit()

            with anyio.fail_after(HANG_GUARD):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, replay)
                    # The replay's update waits on the rival's uncommitted index entry.
                    await until_sql(
                        other,
                        "SELECT count(*) > 0 FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'",
                    )
                    await tx.commit()
    finally:
        await other.close()
    held = f"unique_key 'k' is held by live job {rival}"
    assert result == [admin.Replay(replayed=[], skipped={dead_id: held})]


async def test_stats_queues_and_set_queue_sync_answer_as_the_async_forms(
    conn: asyncpg.Connection, sync_conn: psycopg.Connection[Any], registry: aioq.Registry
) -> None:
    @registry.task(name="t.s", queue="s")
    async def s() -> None: ...

    await s.defer(conn)
    await _bury(conn, await s.defer(conn))
    info = admin.set_queue_sync(sync_conn, "s", max_running=3, rate=(10, 60.0))
    sync_conn.commit()
    again = await admin.set_queue(conn, "s", max_running=3)  # unchanged, but updated_at
    assert dataclasses.replace(info, updated_at=None) == dataclasses.replace(again, updated_at=None)
    assert (info.max_running, info.rate, info.ready, info.dead) == (3, (10, 60.0), 1, 1)
    assert admin.queues_sync(sync_conn) == await admin.queues(conn)
    with pytest.raises(aioq.errors.ConfigError, match="unknown queue 'nowhere'"):
        admin.set_queue_sync(sync_conn, "nowhere", paused=False)
    sync_conn.rollback()

    def steady(stats: admin.Stats) -> admin.Stats:  # ages move on between two reads
        queues = tuple(dataclasses.replace(q, oldest_ready_age=0.0) for q in stats.queues)
        return dataclasses.replace(stats, queues=queues)

    found = admin.stats_sync(sync_conn)
    assert steady(found) == steady(await admin.stats(conn))
    assert [(q.queue, q.ready, q.dead) for q in found.queues] == [("s", 1, 1)]


async def test_workflow_reads_and_cancel_sync_answer_as_the_async_forms(
    conn: asyncpg.Connection, sync_conn: psycopg.Connection[Any], registry: aioq.Registry
) -> None:
    @registry.task(name="t.w")
    async def w(n: int) -> None: ...

    flow = aioq.Workflow("pair")
    first = flow.add(w.call(n=1))
    flow.add(w.call(n=2), after=[first])
    run = await flow.defer(conn)
    other = await aioq.chain(w.call(n=3)).defer(conn)
    assert aioq.workflow_sync(sync_conn, run.id) == await aioq.workflow(conn, run.id)
    assert aioq.workflow_sync(sync_conn, 10**9) is None
    listed = admin.list_workflows_sync(sync_conn)
    assert listed == await admin.list_workflows(conn)
    assert [r.id for r in listed] == [other.id, run.id]
    assert admin.list_workflows_sync(sync_conn, name="pair", limit=1) == await admin.list_workflows(
        conn, name="pair", limit=1
    )

    states = admin.cancel_workflow_sync(sync_conn, run.id)
    sync_conn.commit()
    assert states == dict.fromkeys(sorted(run.jobs.values()), "cancelled")
    assert await admin.cancel_workflow(conn, other.id) == dict.fromkeys(
        other.jobs.values(), "cancelled"
    )
    assert admin.cancel_workflow_sync(sync_conn, run.id) == {}  # nothing live is left
    info = aioq.workflow_sync(sync_conn, run.id)
    assert info is not None
    assert {s.last_error for s in info.steps} == {f"cancelled: workflow run {run.id} cancelled"}


# --- overlapping replays and deletes lock in one order --------------------------------------

INDEX_ORDER = ("SET enable_seqscan = off", "SET enable_bitmapscan = off")
TABLE_ORDER = ("SET enable_indexscan = off", "SET enable_indexonlyscan = off",
               "SET enable_bitmapscan = off")  # fmt: skip


async def _replay_ids(conn: asyncpg.Connection, ids: list[int]) -> None:
    await admin.replay(conn, job_id=ids)


async def _delete_ids(conn: asyncpg.Connection, ids: list[int]) -> None:
    await admin.delete_jobs(conn, ids)


CALLS = {"replay": _replay_ids, "delete": _delete_ids}


async def _call(
    name: str, db: asyncpg.Connection, ids: list[int], errors: list[BaseException]
) -> None:
    try:
        await CALLS[name](db, ids)
    except asyncpg.DeadlockDetectedError as exc:
        errors.append(exc)


@pytest.mark.parametrize(
    ("first", "second"),
    [("replay", "delete"), ("delete", "replay"), ("replay", "replay"), ("delete", "delete")],
)
async def test_overlapping_replays_and_deletes_never_deadlock(
    dsn: str, conn: asyncpg.Connection, first: str, second: str
) -> None:
    """Two admin calls on the same dead jobs, given in opposite orders and read by plans that
    visit the rows in opposite orders (the id index, the table's physical order: a row updated
    since its insert sits after the rows inserted after it), lock the rows in id order, as the
    cancel and the fenced writes do: they wait for each other, never deadlock.

    The interleaving is forced by a third transaction holding the middle row: the first call
    locks the lowest id and waits for it, the second reaches it from the other end. Locking in
    the order each plan met the rows, the two then held one end each and waited for the
    other's: a deadlock, and PostgreSQL aborted one of them."""
    for rounds in range(3):
        low, middle, high = await conn.fetchval(
            "WITH j AS (INSERT INTO aioq.jobs (queue, task, args, status, last_error)"
            " SELECT 'q', 't', '{}', 'dead', 'boom' FROM generate_series(1, 3) RETURNING id)"
            " SELECT array_agg(id ORDER BY id) FROM j"
        )
        # The middle row rewritten, then the low one: the table holds them high, middle, low.
        for job_id in (middle, low):
            await conn.execute("UPDATE aioq.jobs SET last_error = 'again' WHERE id = $1", job_id)
        physical = "SELECT array_agg(id ORDER BY ctid) FROM aioq.jobs WHERE id >= $1"
        assert await conn.fetchval(physical, low) == [high, middle, low]
        holder, one, two = [await asyncpg.connect(dsn) for _ in range(3)]
        errors: list[BaseException] = []
        try:
            for statement in INDEX_ORDER:
                await one.execute(statement)
            for statement in TABLE_ORDER:
                await two.execute(statement)
            holding = holder.transaction()
            await holding.start()
            await holder.execute("SELECT FROM aioq.jobs WHERE id = $1 FOR UPDATE", middle)

            async with anyio.create_task_group() as tg:
                tg.start_soon(_call, first, one, [low, middle, high], errors)
                await until_sql(
                    conn,
                    "SELECT $1 = ANY(pg_blocking_pids($2))",
                    holder.get_server_pid(),
                    one.get_server_pid(),
                )
                tg.start_soon(_call, second, two, [high, middle, low], errors)
                await until_sql(
                    conn, "SELECT cardinality(pg_blocking_pids($1)) > 0", two.get_server_pid()
                )
                await holding.rollback()
        finally:
            for db in (holder, one, two):
                await db.close()
        assert errors == [], f"round {rounds}: {errors}"
