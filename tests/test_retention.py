"""Retention: completed jobs archived in the same statement, pruned in bounded batches."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import asyncpg
import orjson
import pytest
import statements
from waits import until_sql

import aioq
from aioq.job import OutcomeKind
from aioq.sql.jobs import CLAIM_ONE_QUEUE
from aioq.worker.maintenance import Pruner, Vacuumer

pytestmark = pytest.mark.anyio


def pruner(
    db: asyncpg.Connection,
    *,
    archive_retention: float | None = None,
    dead_retention: float | None = None,
    workflow_retention: float | None = None,
    interval: float = 3600.0,
) -> Pruner:
    return Pruner(
        schema="aioq",
        db=db,
        archive_retention=archive_retention,
        dead_retention=dead_retention,
        workflow_retention=workflow_retention,
        interval=interval,
        batch_size=10,
    )


async def count(conn: asyncpg.Connection, sql: str) -> int:
    return await conn.fetchval(sql)  # type: ignore[no-any-return]


async def archive_jobs(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    n: int,
) -> list[int]:
    """Run ``n`` jobs with keep_completed=True (and no pruning); return their ids."""

    @registry.task
    async def work(i: int) -> None: ...

    ids = [await work.defer(conn, i=i) for i in range(n)]
    await make_worker(keep_completed=True, archive_retention=None).run_until_idle()
    return ids


async def test_completed_jobs_are_archived_then_pruned_in_batches(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    ids = await archive_jobs(conn, registry, make_worker, 25)
    assert await count(conn, "SELECT count(*) FROM aioq.jobs") == 0
    rows = await conn.fetch("SELECT id, attempts, worker, finished_at FROM aioq.archive")
    assert sorted(r["id"] for r in rows) == sorted(ids)
    assert all(r["attempts"] == 1 and r["worker"] and r["finished_at"] for r in rows)

    # A long retention keeps recent rows and deletes only the ones made old.
    await conn.execute(
        "UPDATE aioq.archive SET finished_at = now() - interval '2 hours'"
        " WHERE id = ANY($1::bigint[])",
        ids[:3],
    )
    assert await pruner(conn, archive_retention=3600).run_once() == 3
    assert await count(conn, "SELECT count(*) FROM aioq.archive") == 22

    prune = pruner(conn, archive_retention=0)
    assert [await prune.run_once() for _ in range(4)] == [10, 10, 2, 0]
    assert await count(conn, "SELECT count(*) FROM aioq.archive") == 0


async def test_dead_jobs_are_pruned_by_age_in_batches(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def doomed() -> None: ...

    for _ in range(25):
        await doomed.defer(conn)
    claims = await statements.claim(conn, ["default"], 25, "w")
    buried = await statements.write(conn, "w", claims, OutcomeKind.DEAD, error="x")
    assert len(buried) == 25
    pending = await doomed.defer(conn)  # never pruned, however old
    await conn.execute("UPDATE aioq.jobs SET run_at = now() - interval '2 hours'")

    # Dead retention None keeps dead jobs; the archive retention alone prunes nothing here.
    assert await pruner(conn, archive_retention=0).run_once() == 0
    assert await pruner(conn, dead_retention=3 * 3600).run_once() == 0
    prune = pruner(conn, dead_retention=3600)
    assert [await prune.run_once() for _ in range(4)] == [10, 10, 5, 0]
    rows = await conn.fetch("SELECT id, status FROM aioq.jobs")
    assert [(r["id"], r["status"]) for r in rows] == [(pending, "pending")]


async def test_run_repeats_at_once_while_batches_are_full(
    dsn: str,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    await archive_jobs(conn, registry, make_worker, 25)
    prune = pruner(conn, archive_retention=0, interval=3600)  # no second pass without a full batch
    # The pruner owns `conn` while it runs: watch through a connection of our own (sharing it
    # failed now and then with "another operation is in progress").
    probe = await asyncpg.connect(dsn)
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(prune.run)
                await until_sql(probe, "SELECT NOT EXISTS (SELECT FROM aioq.archive)")
                tg.cancel_scope.cancel()
    finally:
        await probe.close()


async def test_worker_runs_the_pruner(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task
    async def work() -> None: ...

    # Three archived rows from long ago, and a dead job just as old.
    await conn.execute(
        """
        INSERT INTO aioq.archive (id, queue, task, args, priority, attempts, max_attempts,
                                  created_at, started_at, finished_at)
        SELECT -g, 'default', 'old', '{}', 0, 1, 5, now() - interval '9 days',
               now() - interval '9 days', now() - interval '8 days'
        FROM generate_series(1, 3) AS g
        """
    )
    dead = await work.defer(conn)
    await conn.execute(
        "UPDATE aioq.jobs SET status = 'dead', run_at = now() - interval '2 days' WHERE id = $1",
        dead,
    )
    fresh = [await work.defer(conn) for _ in range(2)]
    worker = make_worker(keep_completed=True, dead_retention=86400.0, prune_interval=0.05)
    assert worker.config.archive_retention == 7 * 24 * 3600
    with anyio.fail_after(10):
        async with worker:
            await until_sql(
                conn,
                "SELECT (SELECT array_agg(id ORDER BY id) FROM aioq.archive) IS NOT DISTINCT FROM $1"
                " AND NOT EXISTS (SELECT FROM aioq.jobs)",
                fresh,
            )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("archive_retention", -1.0),
        ("dead_retention", float("nan")),
        ("prune_interval", 0.0),
        ("prune_batch", 0),
    ],
)
def test_retention_options_are_validated(field: str, value: float) -> None:
    with pytest.raises(aioq.errors.ConfigError, match=field):
        aioq.WorkerConfig(**{field: value})  # type: ignore[arg-type]


def test_retention_can_be_off() -> None:
    cfg = aioq.WorkerConfig(archive_retention=None, dead_retention=None)
    assert cfg.archive_retention is None
    assert cfg.dead_retention is None


async def dead_tuples(conn: asyncpg.Connection) -> int:
    """The jobs table's dead tuples, with this session's statistics flushed first."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    return await count(
        conn, "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'aioq.jobs'::regclass"
    )


async def test_the_vacuumer_vacuums_the_jobs_table_past_its_threshold(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def work(i: int) -> None: ...

    # No autovacuum nor autoanalyze on this test's table: an ANALYZE between the two reads
    # below replaces n_dead_tup with its sample's estimate (seen under load: the vacuumer then
    # read fewer dead tuples than the threshold it was given).
    await conn.execute("ALTER TABLE aioq.jobs SET (autovacuum_enabled = false)")
    await work.defer_many(conn, [{"i": i} for i in range(300)])
    claims = await statements.claim(conn, ["default"], 300, "w1")
    await statements.write(conn, "w1", claims, OutcomeKind.SUCCEEDED)
    dead = await dead_tuples(conn)
    assert dead >= 300  # each claim and each delete left one

    vacuumer = Vacuumer(schema="aioq", db=conn, threshold=dead + 1, interval=3600)
    assert await vacuumer.run_once() is False  # below the threshold
    assert (
        await count(
            conn, "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'aioq.jobs'::regclass"
        )
        == 0
    )

    vacuumer.threshold = dead
    assert await vacuumer.run_once() is True
    assert (
        await count(
            conn, "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'aioq.jobs'::regclass"
        )
        == 1
    )
    assert await dead_tuples(conn) == 0


async def test_the_vacuumer_leaves_a_table_it_does_not_own_to_autovacuum(
    conn: asyncpg.Connection, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    role = f"aioq_vacuum_{secrets.token_hex(4)}"  # roles are cluster-wide
    await conn.execute(f"DROP ROLE IF EXISTS {role}")
    await conn.execute(f"CREATE ROLE {role} LOGIN")
    try:
        await conn.execute(f"GRANT USAGE ON SCHEMA aioq TO {role}")
        await conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON aioq.jobs TO {role}")
        app = await asyncpg.connect(dsn, user=role)
        try:
            vacuumer = Vacuumer(schema="aioq", db=app, threshold=1, interval=3600)
            with caplog.at_level(logging.INFO, logger="aioq"):
                assert await vacuumer.run_once() is False
                assert await vacuumer.run_once() is False
            assert caplog.text.count("does not own aioq.jobs") == 1
        finally:
            await app.close()
    finally:
        await conn.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA aioq FROM {role}")
        await conn.execute(f"REVOKE ALL ON SCHEMA aioq FROM {role}")
        await conn.execute(f"DROP ROLE {role}")


CLAIM = "claim('default', 10, 'w1', '{}', 3600)"


async def test_the_vacuumer_analyses_the_jobs_table_when_the_planner_believes_it_empty(
    conn: asyncpg.Connection,
) -> None:
    # A worker prepares its statements at start, on a table never vacuumed nor analysed (a new
    # install, or autovacuum off): their generic plans believe it empty. Then a backlog builds
    # up, too few jobs finish for the dead tuples to reach the threshold, and no autovacuum
    # renews the statistics.
    await conn.execute("ALTER TABLE aioq.jobs SET (autovacuum_enabled = false)")
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    # The claim's parameters in ClaimJobs' order: queue, limit, worker, unknown tasks, grace.
    await conn.execute(
        "PREPARE claim(text, integer, text, text[], float8) AS " + CLAIM_ONE_QUEUE.text("aioq")
    )
    await conn.execute(f"EXECUTE {CLAIM}")  # planned now, the table empty
    await conn.execute("INSERT INTO aioq.jobs (task) SELECT 'work' FROM generate_series(1, 20000)")
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await until_sql(
        conn,
        "SELECT n_live_tup >= 20000 FROM pg_stat_user_tables WHERE relid = 'aioq.jobs'::regclass",
    )

    async def rows_read_by_a_claim() -> int:
        """The most rows any scan of aioq.jobs read in one claim of 10 (rolled back)."""
        tx = conn.transaction()
        await tx.start()
        try:
            explained = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {CLAIM}")
        finally:
            await tx.rollback()
        [root] = orjson.loads(explained)
        scans = [
            n
            for n in nodes(root["Plan"])
            if n.get("Relation Name") == "jobs" and "Scan" in n["Node Type"]
        ]
        return max(
            n["Actual Rows"] * n["Actual Loops"] + n.get("Rows Removed by Filter", 0) for n in scans
        )

    assert await rows_read_by_a_claim() >= 20000  # the precondition: the claim scans it all
    vacuumer = Vacuumer(schema="aioq", db=conn, threshold=10**9, interval=3600)
    assert await vacuumer.run_once() is True  # far below the threshold: analysed
    stats = await conn.fetchrow(
        "SELECT reltuples, relpages FROM pg_class WHERE oid = 'aioq.jobs'::regclass"
    )
    assert stats["reltuples"] > 0, stats
    assert await rows_read_by_a_claim() <= 10  # the same prepared claim, planned anew
    assert await vacuumer.run_once() is False  # the statistics are fresh now


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan tree."""
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)
