"""defer() and the admin functions on SQLAlchemy sessions and connections, and on an asyncpg pool."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import anyio
import asyncpg
import orjson
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from waits import HANG_GUARD, eventually, wait_for

import aioq
import aioq.results
from examples.fastapi_sqlalchemy import asyncpg_url, create_app

pytestmark = pytest.mark.anyio


@pytest.fixture
async def engine(dsn: str) -> AsyncIterator[AsyncEngine]:
    eng = create_async_engine(asyncpg_url(dsn))
    yield eng
    await eng.dispose()


@pytest.fixture
def send(registry: aioq.Registry) -> aioq.Task[[int, str], None]:
    @registry.task(queue="mail")
    async def send(order_id: int, note: str = "") -> None:
        pass

    return send


async def test_session_rollback_leaves_no_job_even_when_defer_is_its_first_statement(
    engine: AsyncEngine, conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    # Nothing has run on the session yet: SQLAlchemy's driver-level BEGIN is still to come.
    async with AsyncSession(engine) as session:
        await send.defer(session, order_id=1)
        await session.rollback()
    async with AsyncSession(engine) as session:
        with pytest.raises(RuntimeError, match="boom"):  # noqa: PT012 (the raise is the point)
            async with session.begin():
                await send.defer(session, order_id=2)
                raise RuntimeError("boom")
    assert await aioq.admin.list_jobs(conn) == []


class AppSession(AsyncSession):
    """An application's own session class, defined outside SQLAlchemy's modules."""


async def test_session_commit_writes_the_job_with_the_row(
    engine: AsyncEngine, conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    await conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY)")
    async with AppSession(engine) as session, session.begin():
        await session.execute(text("INSERT INTO orders VALUES (7)"))
        job_id = await send.defer(session, order_id=7, note="hi")
        # Not visible outside the transaction until it commits.
        assert await aioq.admin.get_job(conn, job_id) is None
    job = await aioq.admin.get_job(conn, job_id)
    assert job is not None
    assert (job.task, job.queue) == (send.name, "mail")
    assert orjson.loads(job.args) == {"order_id": 7, "note": "hi"}
    assert await conn.fetchval("SELECT count(*) FROM orders") == 1


async def test_connection_savepoints_options_defer_many_and_admin_functions(
    engine: AsyncEngine, conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    async with engine.connect() as sa_conn:
        first = await send.options(priority=5, queue="urgent").defer(sa_conn, order_id=1)
        nested = await sa_conn.begin_nested()
        await send.defer(sa_conn, order_id=2)
        await nested.rollback()  # the savepoint's job goes, the outer one stays
        many = await send.defer_many(sa_conn, [{"order_id": 3}, {"order_id": 4}])
        # The admin functions see the uncommitted jobs on the same transaction.
        listed = await aioq.admin.list_jobs(sa_conn)
        assert [job.id for job in listed] == [first, *many]
        assert await aioq.admin.cancel_jobs(sa_conn, [many[0]]) == {many[0]: "cancelled"}
        job = await aioq.admin.get_job(sa_conn, first)
        assert job is not None
        assert (job.priority, job.queue) == (5, "urgent")
        assert (await aioq.admin.stats(sa_conn)).queues
        await sa_conn.commit()
    assert [(job.id, job.status) for job in await aioq.admin.list_jobs(conn)] == [
        (first, "pending"),
        (many[0], "cancelled"),  # kept, like a dead job
        (many[1], "pending"),
    ]


async def test_jsonb_read_through_sqlalchemys_codecs(
    engine: AsyncEngine, send: aioq.Task[[int, str], None]
) -> None:
    # SQLAlchemy installs its own jsonb codec on the asyncpg connection; aioq's values must not
    # go through it in either direction.
    async with AsyncSession(engine) as session, session.begin():
        job_id = await send.defer(session, order_id=1, note='quote " and é')
        stored = await session.scalar(
            text("SELECT args FROM aioq.jobs WHERE id = :id"), {"id": job_id}
        )
        assert stored == {"order_id": 1, "note": 'quote " and é'}  # decoded by SQLAlchemy
        job = await aioq.admin.get_job(session, job_id)
        assert job is not None
        assert isinstance(job.args, str)  # aioq reads the text, not SQLAlchemy's decoded value
        assert orjson.loads(job.args) == stored


async def test_pool_defers_in_its_own_transaction(
    dsn: str, conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        job_id = await send.defer(pool, order_id=1)
        ids = await send.defer_many(pool, [{"order_id": 2}])
        again = await send.options(unique_key="k").defer(pool, order_id=3)
        assert await send.options(unique_key="k").defer(pool, order_id=4) == again
        assert [job.id for job in await aioq.admin.list_jobs(pool)] == [job_id, *ids, again]
    assert len(await aioq.admin.list_jobs(conn)) == 3  # committed


async def test_other_drivers_and_objects_get_a_clear_error_and_write_nothing(
    dsn: str, conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    psycopg_engine = create_async_engine(asyncpg_url(dsn).replace("+asyncpg", "+psycopg"))
    try:
        async with AsyncSession(psycopg_engine) as session:
            with pytest.raises(
                aioq.errors.ConfigError, match=r"'psycopg' driver.*postgresql\+asyncpg"
            ):
                await send.defer(session, order_id=1)
        async with psycopg_engine.connect() as sa_conn:
            with pytest.raises(aioq.errors.ConfigError, match="asyncpg"):
                await aioq.admin.list_jobs(sa_conn)
    finally:
        await psycopg_engine.dispose()
    with pytest.raises(
        aioq.errors.ConfigError, match=r"conn: got builtins\.str; expected an asyncpg"
    ):
        await send.defer("postgresql://nope", order_id=1)  # type: ignore[arg-type]
    assert await aioq.admin.list_jobs(conn) == []


def test_importing_aioq_and_deferring_on_asyncpg_loads_no_sqlalchemy() -> None:
    code = (
        "import sys, aioq, aioq.db\n"
        "assert 'sqlalchemy' not in sys.modules and 'aioq.contrib.sqlalchemy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def counts_reach(client: TestClient, what: str, **expected: int) -> dict[str, int]:
    """Wait until the app's ``/counts`` show ``expected``; return them."""
    counts: dict[str, int] = {}

    def reached() -> bool:
        counts.update(client.get("/counts").json())
        return all(counts[k] == v for k, v in expected.items())

    wait_for(reached, what, 30, on_timeout=lambda: str(counts), every=0.05)
    return counts


def test_fastapi_sqlalchemy_example_commit_rollback_and_exception_in_begin(dsn: str) -> None:
    with TestClient(create_app(dsn, concurrency=2)) as client:
        ok = client.post("/signup", json={"email": "ada@example.org"})
        assert ok.status_code == 201, ok.text
        assert ok.json()["committed"] is True
        counts_reach(client, "the committed signup's welcome", users=1, welcomes=1, jobs=0)

        # Rolled back on purpose, after the flush and the defer.
        dry = client.post("/signup", json={"email": "bob@example.org", "dry_run": True})
        assert dry.status_code == 201
        assert dry.json()["committed"] is False
        # An exception raised inside session.begin() after the defer.
        blocked = client.post("/signup", json={"email": "eve@spam.example"})
        assert blocked.status_code == 422, blocked.text
        # The flush fails inside session.begin(): the email is taken.
        taken = client.post("/signup", json={"email": "ada@example.org"})
        assert taken.status_code == 409, taken.text
        # A committed job after the failures proves the worker was free to run any leftovers.
        user_id = ok.json()["user_id"]
        resent = client.post(f"/resend/{user_id}")
        assert resent.status_code == 202, resent.text
        # A job deferred in a rolled-back transaction that had leaked would be in the queue for
        # good: its user does not exist, so the welcome fails on the foreign key and retries.
        counts = counts_reach(client, "the resent welcome", jobs=0)
        assert counts == {"users": 1, "welcomes": 1, "jobs": 0}


async def test_awaiting_a_result_on_a_session_waits_outside_its_transaction(
    engine: AsyncEngine,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @registry.task(result_ttl=60)
    async def double(n: int) -> int:
        return 2 * n

    async with AsyncSession(engine) as session:
        async with session.begin():
            job_id = await double.defer(session, n=21)
        # No polls after the first read: only the results channel's notification can wake the
        # waiter, and a LISTEN inside a transaction would hear nothing until it commits.
        monkeypatch.setattr(aioq.results, "_FIRST_POLL", 3600.0)
        await session.execute(text("SELECT 1"))  # the caller's own transaction is open
        mine = await session.scalar(text("SELECT pg_backend_pid()"))
        got: list[int] = []
        async with anyio.create_task_group() as tg:

            async def wait() -> None:
                got.append(await aioq.result(session, job_id, timeout=HANG_GUARD))

            tg.start_soon(wait)
            await eventually(lambda: aioq.results.listening_connections() == 1, "the LISTEN")
            [hub] = aioq.results._hubs.values()
            pid = hub.db.get_server_pid()
            assert pid != mine  # not the session's connection ...
            assert await state_of(engine, pid) == "idle"  # ... and in no transaction
            await make_worker().run_until_idle()
        assert got == [42]
        assert session.in_transaction()  # the caller's transaction, untouched
        assert await session.scalar(text("SELECT pg_backend_pid()")) == mine
    # A session with no transaction open stays without one; the engine has its connection back.
    async with AsyncSession(engine) as session:
        assert await aioq.result(session, job_id) == 42
        assert not session.in_transaction()
    assert aioq.results.listening_connections() == 0
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]


async def state_of(engine: AsyncEngine, pid: int) -> str:
    """A backend's state: idle, idle in transaction, active."""
    async with engine.connect() as sa_conn:
        found = await sa_conn.scalar(
            text("SELECT state FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        )
        return str(found)


async def test_a_result_awaited_in_the_job_s_own_uncommitted_transaction_says_so(
    engine: AsyncEngine,
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No worker sees a job before its transaction commits: awaiting it inside that transaction
    can only time out (asyncpg, waiting in the transaction) or find nothing (a session, waiting
    outside it); each says why."""

    @registry.task(result_ttl=60)
    async def double(n: int) -> int:
        return 2 * n

    why = "deferred in the transaction that waits for it, which has not committed"
    async with conn.transaction():
        job_id = await double.defer(conn, n=1)
        with pytest.raises(aioq.ResultTimeout, match=why):
            await aioq.result(conn, job_id, timeout=0.2)
    assert [r.levelname for r in caplog.records if r.name == "aioq.results"] == ["WARNING"]
    # Deferred inside a savepoint (the row carries the subtransaction's xid), released or not.
    async with conn.transaction():
        await conn.execute("CREATE TEMP TABLE first_write (x int)")  # the outer xid comes first
        async with conn.transaction():
            in_savepoint = await double.defer(conn, n=3)
            with pytest.raises(aioq.ResultTimeout, match=why):
                await aioq.result(conn, in_savepoint, timeout=0.2)
        with pytest.raises(aioq.ResultTimeout, match=why):
            await aioq.result(conn, in_savepoint, timeout=0.2)
        await conn.execute("DROP TABLE first_write")
    async with conn.transaction():  # committed now; this transaction writes something else
        await conn.execute("CREATE TEMP TABLE scratch (x int)")
        with pytest.raises(aioq.ResultTimeout) as info:
            await aioq.result(conn, job_id, timeout=0.2)
        assert str(info.value) == f"job {job_id} is still pending after 0.2s"
        await conn.execute("DROP TABLE scratch")

    async with AsyncSession(engine) as session, session.begin():
        in_session = await double.defer(session, n=2)
        with pytest.raises(aioq.ResultMissing, match=why):
            await aioq.result(session, in_session, timeout=HANG_GUARD)
        with pytest.raises(aioq.ResultMissing, match="no result is stored"):
            await aioq.result(session, 10**9, timeout=HANG_GUARD)  # missing indeed
        await session.rollback()
    async with AsyncSession(engine) as session:  # no transaction: none is begun to look
        with pytest.raises(aioq.ResultMissing, match="no result is stored"):
            await aioq.result(session, 10**9)
        assert not session.in_transaction()
