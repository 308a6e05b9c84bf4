"""The schema: idempotent versioned install, schema names, the claim's index, CHECK constraints."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import anyio
import asyncpg
import orjson
import pytest
import statements

import aioq
from aioq.migrate import migrations
from aioq.sql import Statement, channel_name
from aioq.sql.control import CANCEL_REQUESTED
from aioq.sql.jobs import CLAIM_ONE_QUEUE, CLAIM_QUEUES
from aioq.sql.outcomes import (
    COMPLETE,
    HEARTBEAT,
    RELEASE_WORKER,
    RESCUE_EXPIRED,
    WRITE_OUTCOMES,
)

pytestmark = pytest.mark.anyio

LATEST = len(migrations())


Connect = Callable[[], Awaitable[asyncpg.Connection]]


@pytest.fixture
async def connect_empty(admin_dsn: str) -> AsyncIterator[Connect]:
    """Connect to a brand-new database of this test's own, with no aioq schema at all."""
    name = f"aioq_empty_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield partial(asyncpg.connect, admin_dsn, database=name)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def versions(conn: asyncpg.Connection, schema: str = "aioq") -> list[int]:
    rows = await conn.fetch(f'SELECT version FROM "{schema}".migrations ORDER BY version')
    return [row["version"] for row in rows]


# --- install ------------------------------------------------------------------------------


async def test_install_is_idempotent_and_versioned(conn: asyncpg.Connection) -> None:
    assert LATEST >= 1
    assert await versions(conn) == list(range(1, LATEST + 1))
    assert await aioq.install(conn) == []
    assert await aioq.install(conn) == []
    assert await versions(conn) == list(range(1, LATEST + 1))
    assert not conn.is_in_transaction()


async def test_install_into_a_fresh_database_and_another_schema(connect_empty: Connect) -> None:
    conn = await connect_empty()
    try:
        assert await aioq.install(conn, schema="other_q") == list(range(1, LATEST + 1))
        assert await aioq.install(conn, schema="other_q") == []
        assert await versions(conn, "other_q") == list(range(1, LATEST + 1))
        assert await conn.fetchval("SELECT to_regnamespace('aioq')") is None

        registry = aioq.Registry(schema="other_q")

        @registry.task
        async def work(n: int) -> None: ...

        job_id = await work.defer(conn, n=1)
        [many_id] = await work.defer_many(conn, [{"n": 2}])
        rows = await conn.fetch("SELECT id, task FROM other_q.jobs ORDER BY id")
        assert [tuple(r) for r in rows] == [(job_id, work.name), (many_id, work.name)]
    finally:
        await conn.close()


async def test_other_schema_rings_its_own_channel(connect_empty: Connect) -> None:
    heard = anyio.Event()
    payloads: list[tuple[str, str]] = []

    def on_notify(_conn: object, _pid: int, channel: str, payload: str) -> None:
        payloads.append((channel, payload))
        heard.set()

    conn = await connect_empty()
    try:
        await aioq.install(conn, schema="other_q")
        listener = await connect_empty()
        try:
            await listener.add_listener(channel_name("other_q"), on_notify)
            # As a worker about to sleep on "mail" does: inserts ring only for awaited queues.
            await statements.arm(listener, ["mail"], schema="other_q")
            registry = aioq.Registry(schema="other_q")

            @registry.task(queue="mail")
            async def work() -> None: ...

            await work.defer(conn)
            with anyio.fail_after(10):
                await heard.wait()
        finally:
            await listener.close()
    finally:
        await conn.close()
    assert payloads == [("aioq:other_q", "mail")]


async def test_concurrent_installs_both_succeed(conn: asyncpg.Connection, dsn: str) -> None:
    schema = f"race_{secrets.token_hex(4)}"
    other = await asyncpg.connect(dsn)
    results: list[list[int]] = []

    async def install(connection: asyncpg.Connection) -> None:
        results.append(await aioq.install(connection, schema=schema))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(install, conn)
            tg.start_soon(install, other)
    finally:
        await other.close()
    assert sorted(results) == [[], list(range(1, LATEST + 1))]
    assert await versions(conn, schema) == list(range(1, LATEST + 1))


@pytest.mark.parametrize("schema", ["x; drop table", "1abc", "a" * 70, "", 'a"b', "a-b", "é"])
async def test_invalid_schema_names_are_refused(conn: asyncpg.Connection, schema: str) -> None:
    with pytest.raises(aioq.errors.ConfigError, match="schema"):
        await aioq.install(conn, schema=schema)
    with pytest.raises(aioq.errors.ConfigError):
        aioq.Registry(schema=schema)
    with pytest.raises(aioq.errors.ConfigError):
        aioq.admin.schema_sql(schema)
    with pytest.raises(aioq.errors.ConfigError):
        CLAIM_ONE_QUEUE.text(schema)
    assert not conn.is_in_transaction()
    schemas = await conn.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname NOT LIKE 'pg_%'")
    assert schemas == 3  # public, information_schema, aioq


def test_schema_sql_is_rendered_for_the_schema() -> None:
    sql = aioq.admin.schema_sql("q2")
    assert '"q2".jobs' in sql
    assert "@schema" not in sql
    assert '"aioq"' not in sql


# --- the claim's index --------------------------------------------------------------------


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan tree."""
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


@pytest.mark.parametrize(
    ("statement", "queues"),
    [(CLAIM_ONE_QUEUE, "default"), (CLAIM_QUEUES, ["default", "other"])],
    ids=["one queue", "two queues"],
)
# A prepared claim may run with a generic plan, which guesses LIMIT $2 at a tenth of the ready
# rows: that plan must not scan the table either.
@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
async def test_claim_plan_uses_the_partial_index(
    conn: asyncpg.Connection, statement: Statement[Any], queues: object, plan_cache_mode: str
) -> None:
    registry = aioq.Registry()

    @registry.task
    async def work(n: int) -> None: ...

    await work.defer_many(conn, [{"n": n} for n in range(20_000)])
    await conn.execute("UPDATE aioq.jobs SET status = 'dead'")
    for _ in range(15):
        await work.defer_many(conn, [{"n": n} for n in range(2_000)])
    await work.options(queue="other").defer_many(conn, [{"n": n} for n in range(2_000)])
    await conn.execute("VACUUM ANALYZE aioq.jobs")

    sql = statement.text("aioq")
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(f"SET LOCAL plan_cache_mode = {plan_cache_mode}")
        queue_type, queue_value = (
            ("text[]", "ARRAY['default', 'other']")
            if isinstance(queues, list)
            else ("text", "'default'")
        )
        await conn.execute(f"PREPARE claim({queue_type}, integer, text, text[], float8) AS {sql}")
        explained = await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON)"
            f" EXECUTE claim({queue_value}, 10, 'w1', ARRAY['gone'], 3600)"
        )
    finally:
        await tx.rollback()
    [root] = orjson.loads(explained)
    nodes = list(plan_nodes(root["Plan"]))
    scans = [(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in nodes]
    assert ("Index Scan", "jobs", "jobs_claim_idx") in scans, scans
    assert not [s for s in scans if s[0] == "Seq Scan"], scans
    # The planner may fetch the picked ids through a bitmap of the primary key (seen under
    # load); that reads only those rows. A bitmap over anything else would scan the backlog.
    for node in nodes:
        if node["Node Type"] == "Bitmap Heap Scan":
            [bitmap] = node["Plans"]
            assert bitmap.get("Index Name") == "jobs_pkey", scans
            assert node["Actual Rows"] * node["Actual Loops"] <= 10, node
    # The index gives the order: no row of the backlog is sorted; each scan stops at the limit.
    sorted_rows = [n["Actual Rows"] * n["Actual Loops"] for n in nodes if n["Node Type"] == "Sort"]
    assert sum(sorted_rows) <= 10 * len(queues if isinstance(queues, list) else [queues])
    claim_scans = [n for n in nodes if n.get("Index Name") == "jobs_claim_idx"]
    assert all(n["Actual Rows"] <= 10 for n in claim_scans), claim_scans
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE status = 'running'") == 0


# The fenced writes (and the cancel watch's read) take ids and claim numbers as arrays. Each
# must look its rows up by primary key, whatever the statistics say: analysed while nothing ran
# (a quiet queue before a burst), a generic plan once walked every running row and rescanned
# the arrays for each, a second per batch of 1 000 with 3 000 running.
@pytest.mark.parametrize(
    ("statement", "types", "extra"),
    [
        (COMPLETE, "", ""),
        (HEARTBEAT, "", ""),
        (CANCEL_REQUESTED, "", ""),
        (
            WRITE_OUTCOMES,
            ", text[], float8[], text[], text[], float8[], boolean, text",
            ", array_fill('released'::text, ARRAY[1000]), array_fill(0::float8, ARRAY[1000]),"
            " array_fill(NULL::text, ARRAY[1000]), array_fill(NULL::text, ARRAY[1000]),"
            " array_fill(NULL::float8, ARRAY[1000]), false, 'results'",
        ),
    ],
    ids=["complete", "heartbeat", "cancel requested", "write outcomes"],
)
@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
async def test_fenced_statements_look_rows_up_by_id(
    conn: asyncpg.Connection,
    statement: Statement[Any],
    types: str,
    extra: str,
    plan_cache_mode: str,
) -> None:
    await conn.execute(
        "INSERT INTO aioq.jobs (task, args) SELECT 'work', '{}' FROM generate_series(1, 20000)"
    )
    await conn.execute("VACUUM ANALYZE aioq.jobs")  # nothing runs
    await conn.execute(
        "UPDATE aioq.jobs SET status = 'running', locked_by = 'w1', claims = 1, attempts = 1,"
        " lease_expires_at = now() + interval '30 s' WHERE id <= 3000"
    )
    held = "'{" + ",".join(str(i) for i in range(3000, 2000, -1)) + "}'::bigint[]"
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(f"SET LOCAL plan_cache_mode = {plan_cache_mode}")
        await conn.execute(
            f"PREPARE fenced(bigint[], integer[], text{types}) AS {statement.text('aioq')}"
        )
        explained = await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE fenced("
            f"{held}, array_fill(1, ARRAY[1000]), 'w1'{extra})"
        )
    finally:
        await tx.rollback()
    [root] = orjson.loads(explained)
    nodes = list(plan_nodes(root["Plan"]))
    scans = [n for n in nodes if n.get("Relation Name") == "jobs" and "Scan" in n["Node Type"]]
    assert scans, nodes
    for scan in scans:  # one probe of the primary key per id, never a walk of the running rows
        assert scan.get("Index Name") == "jobs_pkey", scan
        assert scan["Actual Rows"] * scan["Actual Loops"] <= 1000, scan
    # The arrays are read once (a row's outcome is then found by its key, once per row).
    rescanned = [
        n
        for n in nodes
        if n["Node Type"] == "Function Scan"
        and n.get("Function Name") == "unnest"
        and n["Actual Loops"] > 1
    ]
    assert not rescanned, rescanned


# A queue that keeps up is often empty when it is vacuumed: VACUUM then records no live row
# over the pages it kept, and the planner prices the whole table at one row however large it
# grows. A join of the table with the batch's ids was then planned as a walk of the whole
# primary key, each of its rows tested against every id: with the worker behind, each batch
# took longer the longer the backlog (seconds at 300 000 jobs), the worker fell further
# behind, and the soak's worker stopped (docs/architecture.md, "The fence"). Every write of
# the worker's claims (and the reaper's) reads only the rows it writes, whatever the backlog.
N_HELD = 200


@pytest.mark.parametrize(
    ("statement", "types", "args"),
    [
        (COMPLETE, "bigint[], integer[], text", "$ids, $claims, 'w1'"),
        (HEARTBEAT, "bigint[], integer[], text", "$ids, $claims, 'w1'"),
        (
            WRITE_OUTCOMES,
            "bigint[], integer[], text, text[], float8[], text[], text[], float8[], boolean, text",
            "$ids, $claims, 'w1',"
            " array_fill('succeeded'::text, ARRAY[$half]) || array_fill('retried'::text, ARRAY[$half]),"
            " array_fill(1::float8, ARRAY[$n]), array_fill('E: x'::text, ARRAY[$n]),"
            " array_fill('1'::text, ARRAY[$n]), array_fill(60::float8, ARRAY[$n]), false, 'r'",
        ),
        (RELEASE_WORKER, "text, bigint[]", "'w1', '{}'::bigint[]"),
        (RESCUE_EXPIRED, "integer, text", "1000, 'w2'"),
    ],
    ids=["complete", "heartbeat", "write outcomes", "release worker", "rescue expired"],
)
@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
async def test_writes_of_a_batch_read_only_its_rows_when_the_table_was_vacuumed_empty(
    conn: asyncpg.Connection, statement: Statement[Any], types: str, args: str, plan_cache_mode: str
) -> None:
    # No autovacuum or autoanalyze may correct the statistics behind the test's back.
    await conn.execute("ALTER TABLE aioq.jobs SET (autovacuum_enabled = false)")
    await conn.execute("INSERT INTO aioq.jobs (task) SELECT 'work' FROM generate_series(1, 2000)")
    await conn.execute("DELETE FROM aioq.jobs")  # the queue kept up: every job done
    await conn.execute("VACUUM (TRUNCATE false) aioq.jobs")  # as when a claim holds the lock
    stats = await conn.fetchrow(
        "SELECT relpages, reltuples FROM pg_class WHERE oid = 'aioq.jobs'::regclass"
    )
    assert stats["relpages"] > 0, stats  # the precondition: pages kept, no live row in them
    assert stats["reltuples"] == 0, stats
    # Then the worker fell behind: a backlog, and a batch of claims, their leases expired.
    await conn.execute("INSERT INTO aioq.jobs (task) SELECT 'work' FROM generate_series(1, 20000)")
    ids = await conn.fetchval(
        "WITH c AS (UPDATE aioq.jobs SET status = 'running', locked_by = 'w1', claims = 1,"
        " attempts = 1, locked_at = now() - interval '31 s', lease_expires_at = now() - interval '1 s'"
        f" WHERE id IN (SELECT id FROM aioq.jobs ORDER BY id LIMIT {N_HELD}) RETURNING id)"
        " SELECT array_agg(id ORDER BY id) FROM c"
    )
    values = (
        args.replace("$ids", "'{" + ",".join(map(str, ids)) + "}'::bigint[]")
        .replace("$claims", f"array_fill(1, ARRAY[{N_HELD}])")
        .replace("$half", str(N_HELD // 2))
        .replace("$n", str(N_HELD))
    )
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(f"SET LOCAL plan_cache_mode = {plan_cache_mode}")
        await conn.execute(f"PREPARE batch({types}) AS {statement.text('aioq')}")
        explained = await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE batch({values})")
    finally:
        await tx.rollback()
    [root] = orjson.loads(explained)
    nodes = list(plan_nodes(root["Plan"]))
    scans = [n for n in nodes if n.get("Relation Name") == "jobs" and "Scan" in n["Node Type"]]
    assert scans, nodes
    for scan in scans:  # the held rows, looked up by id: never a walk of the backlog
        assert scan["Actual Rows"] * scan["Actual Loops"] <= N_HELD, scan
    assert root["Plan"]["Actual Rows"] == N_HELD  # and every one of them written


async def test_a_claim_across_queues_takes_priority_then_fifo(conn: asyncpg.Connection) -> None:
    registry = aioq.Registry()

    @registry.task
    async def work(n: int) -> None: ...

    low = await work.options(queue="q1").defer_many(conn, [{"n": n} for n in range(3)])
    [high_q2_a, high_q2_b] = await work.options(queue="q2", priority=5).defer_many(
        conn, [{"n": 0}, {"n": 1}]
    )
    high_q1 = await work.options(queue="q1", priority=5).defer(conn, n=0)
    await work.options(queue="q3", priority=9).defer(conn, n=0)  # not served

    claims = await statements.claim(conn, ["q1", "q2"], 4, "w1")
    assert [c.id for c in claims] == [high_q2_a, high_q2_b, high_q1, low[0]]
    assert [c.id for c in await statements.claim(conn, ["q1", "q2"], 4, "w1")] == low[1:]
    pending = await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE status = 'pending'")
    assert pending == 1  # q3's


# --- constraints --------------------------------------------------------------------------


async def test_job_arguments_are_compressed_with_lz4_where_the_server_has_it(
    conn: asyncpg.Connection,
) -> None:
    try:
        async with conn.transaction():
            await conn.execute("SET LOCAL default_toast_compression = lz4")
    except asyncpg.PostgresError:
        pytest.skip("this PostgreSQL is built without lz4: the arguments keep pglz")
    compression = await conn.fetchval(
        "SELECT attcompression FROM pg_attribute"
        " WHERE attrelid = 'aioq.jobs'::regclass AND attname = 'args'"
    )
    assert compression == b"l"  # "char": asyncpg gives bytes


async def test_status_check_rejects_unknown_statuses(conn: asyncpg.Connection) -> None:
    for status in ("done", "PENDING", ""):
        with pytest.raises(asyncpg.CheckViolationError) as info:
            await conn.execute("INSERT INTO aioq.jobs (task, status) VALUES ('t', $1)", status)
        assert info.value.constraint_name == "jobs_status_check"
    await conn.execute("INSERT INTO aioq.jobs (task, status) VALUES ('t', 'dead')")


async def test_running_requires_an_owner_and_a_lease(conn: asyncpg.Connection) -> None:
    job_id = await conn.fetchval("INSERT INTO aioq.jobs (task) VALUES ('t') RETURNING id")
    for assignments in (
        "status = 'running'",
        "status = 'running', lease_expires_at = now()",
        "status = 'running', locked_by = 'w1'",
    ):
        with pytest.raises(asyncpg.CheckViolationError) as info:
            await conn.execute(f"UPDATE aioq.jobs SET {assignments} WHERE id = $1", job_id)
        assert info.value.constraint_name == "jobs_running_locked"
    await conn.execute(
        "UPDATE aioq.jobs SET status = 'running', locked_by = 'w1', lease_expires_at = now()"
        " WHERE id = $1",
        job_id,
    )
