"""defer_sync on synchronous connections: the contract of tests/test_defer.py, from sync code.

Every test runs on each kind of connection a synchronous caller holds: psycopg 3, psycopg 2,
a SQLAlchemy Session and a SQLAlchemy Connection (both on psycopg). Django's connection is
covered in tests/test_django.py, which runs a Django project.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import orjson
import psycopg
import psycopg2
import psycopg2.extras
import pytest
import sqlalchemy
import test_defer
from psycopg.rows import dict_row
from sqlalchemy.orm import Session
from test_defer import ROUND_TRIP_VALUES, Doorbells, same_types

import aioq
from aioq.sql.jobs import TABLE_DEFAULTS


class Sync:
    """A caller's synchronous connection: ``target`` goes to defer_sync; ``sql`` runs its own
    statements in the same transaction."""

    def __init__(
        self,
        target: Any,
        sql: Callable[[str], list[tuple[Any, ...]]],
        commit: Callable[[], None],
        rollback: Callable[[], None],
        close: Callable[[], None],
    ) -> None:
        self.target = target
        self.sql = sql
        self.commit = commit
        self.rollback = rollback
        self.close = close

    def value(self, query: str) -> Any:
        return self.sql(query)[0][0]


def _psycopg(dsn: str) -> Sync:
    conn = psycopg.connect(dsn, row_factory=dict_row)  # aioq reads tuples whatever the factory

    def sql(query: str) -> list[tuple[Any, ...]]:
        cur = conn.execute(query)
        return [tuple(r.values()) for r in cur.fetchall()] if cur.description else []

    return Sync(conn, sql, conn.commit, conn.rollback, conn.close)


def _psycopg2(dsn: str) -> Sync:
    conn = psycopg2.connect(dsn, cursor_factory=psycopg2.extras.RealDictCursor)

    def sql(query: str) -> list[tuple[Any, ...]]:
        with conn.cursor() as cur:
            cur.execute(query)
            return [tuple(r.values()) for r in cur.fetchall()] if cur.description else []

    return Sync(conn, sql, conn.commit, conn.rollback, conn.close)


def _engine(dsn: str) -> sqlalchemy.Engine:
    return sqlalchemy.create_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1))


def _session(dsn: str) -> Sync:
    engine = _engine(dsn)
    session = Session(engine)

    def sql(query: str) -> list[tuple[Any, ...]]:
        result = session.execute(sqlalchemy.text(query))
        return [tuple(r) for r in result] if result.returns_rows else []

    def close() -> None:
        session.close()
        engine.dispose()

    return Sync(session, sql, session.commit, session.rollback, close)


def _sa_connection(dsn: str) -> Sync:
    engine = _engine(dsn)
    conn = engine.connect()

    def sql(query: str) -> list[tuple[Any, ...]]:
        result = conn.execute(sqlalchemy.text(query))
        return [tuple(r) for r in result] if result.returns_rows else []

    def close() -> None:
        conn.close()
        engine.dispose()

    return Sync(conn, sql, conn.commit, conn.rollback, close)


doorbells = test_defer.doorbells  # the fixture: a listener armed as a sleeping worker

KINDS = {
    "psycopg": _psycopg,
    "psycopg2": _psycopg2,
    "sa-session": _session,
    "sa-connection": _sa_connection,
}


@pytest.fixture(params=sorted(KINDS))
def sync(request: pytest.FixtureRequest, dsn: str) -> Iterator[Sync]:
    """A synchronous connection of each kind to this test's database."""
    made = KINDS[request.param](dsn)
    yield made
    made.close()


@pytest.fixture
def other(dsn: str) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    """A second connection, in autocommit: what the rest of the world sees."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


def count(conn: psycopg.Connection[tuple[Any, ...]], queue: str | None = None) -> int:
    row = conn.execute(
        "SELECT count(*) FROM aioq.jobs WHERE %(q)s::text IS NULL OR queue = %(q)s", {"q": queue}
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def send(registry: aioq.Registry) -> aioq.Task[[int, str], None]:
    @registry.task
    def send(order_id: int, note: str = "") -> None:
        """Send an order confirmation."""

    return send


# --- transactional enqueue ----------------------------------------------------------------


def test_committed_defer_writes_the_row_with_its_options(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], registry: aioq.Registry
) -> None:
    @registry.task(queue="orders", priority=4, max_attempts=9)
    def charge(order_id: int, amount: float, tags: list[str]) -> None: ...

    job_id = charge.defer_sync(sync.target, order_id=7, amount=12.5, tags=["a", "b"])
    assert count(other) == 0  # inside the caller's transaction: nobody else sees it yet
    sync.commit()
    row = other.execute(
        "SELECT queue, task, priority, max_attempts, args::text, status, unique_key"
        " FROM aioq.jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None
    assert row[:4] == ("orders", charge.name, 4, 9)
    assert orjson.loads(row[4]) == {"order_id": 7, "amount": 12.5, "tags": ["a", "b"]}
    assert row[5:] == ("pending", None)


def test_rolled_back_defer_writes_nothing(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], send: aioq.Task[[int, str], None]
) -> None:
    send.defer_sync(sync.target, order_id=1)
    send.defer_many_sync(sync.target, [{"order_id": 2}, {"order_id": 3}])
    assert sync.value("SELECT count(*) FROM aioq.jobs") == 3
    sync.rollback()
    assert count(other) == 0
    assert sync.value("SELECT count(*) FROM aioq.jobs") == 0


def test_defer_uses_the_callers_connection_and_never_commits(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], send: aioq.Task[[int, str], None]
) -> None:
    backends = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    sync.value("SELECT 1")  # connected
    before = other.execute(backends).fetchone()
    job_id = send.defer_sync(sync.target, order_id=1)
    [many_id] = send.defer_many_sync(sync.target, [{"order_id": 2}])
    assert other.execute(backends).fetchone() == before
    assert count(other) == 0
    assert sync.value("SELECT count(*) FROM aioq.jobs") == 2
    sync.commit()
    found = other.execute("SELECT id FROM aioq.jobs ORDER BY id").fetchall()
    assert [r[0] for r in found] == [job_id, many_id]


def test_rolled_back_savepoint_keeps_the_outer_transactions_jobs(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], send: aioq.Task[[int, str], None]
) -> None:
    kept = send.defer_sync(sync.target, order_id=1)
    sync.sql("SAVEPOINT inner_one")
    send.defer_sync(sync.target, order_id=2)
    send.defer_many_sync(sync.target, [{"order_id": 3}])
    sync.sql("SAVEPOINT inner_two")
    send.defer_sync(sync.target, order_id=4)
    sync.sql("ROLLBACK TO SAVEPOINT inner_one")
    also_kept = send.defer_sync(sync.target, order_id=5)
    sync.sql("SAVEPOINT released")
    released = send.defer_sync(sync.target, order_id=6)
    sync.sql("RELEASE SAVEPOINT released")
    sync.commit()
    ids = other.execute("SELECT id FROM aioq.jobs ORDER BY id").fetchall()
    assert [r[0] for r in ids] == [kept, also_kept, released]


@pytest.mark.parametrize("kind", ["psycopg", "psycopg2"])
def test_autocommit_defer_is_visible_at_once(
    dsn: str,
    kind: str,
    other: psycopg.Connection[tuple[Any, ...]],
    send: aioq.Task[[int, str], None],
) -> None:
    made = KINDS[kind](dsn)
    try:
        made.target.autocommit = True
        job_id = send.defer_sync(made.target, order_id=1)
        assert other.execute("SELECT task FROM aioq.jobs WHERE id = %s", (job_id,)).fetchone() == (
            send.name,
        )
    finally:
        made.close()


def test_a_psycopg_cursor_defers_on_its_connection(
    dsn: str, other: psycopg.Connection[tuple[Any, ...]], send: aioq.Task[[int, str], None]
) -> None:
    with psycopg.connect(dsn) as conn, conn.cursor() as cursor:
        cursor.execute("SELECT 41 + 1")
        job_id = send.defer_sync(cursor, order_id=1)
        assert cursor.fetchone() == (42,)  # the caller's cursor keeps its own result
        conn.rollback()
        assert send.defer_sync(cursor, order_id=2) != job_id
    assert count(other) == 1  # the context manager committed the second one


@pytest.mark.anyio
async def test_doorbell_rings_at_commit_only(
    sync: Sync, send: aioq.Task[[int, str], None], doorbells: Doorbells
) -> None:
    send.options(queue="rolled-back").defer_sync(sync.target, order_id=1)
    sync.rollback()
    send.options(queue="three").defer_many_sync(sync.target, [{"order_id": 2}] * 3)
    send.options(queue="three").defer_sync(sync.target, order_id=3)
    sync.commit()
    send.options(queue="sentinel").defer_sync(sync.target, order_id=4)
    sync.commit()
    assert await doorbells.until("sentinel") == ["three"]


# --- options ------------------------------------------------------------------------------


def test_options_are_stored(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], send: aioq.Task[[int, str], None]
) -> None:
    when = datetime(2031, 2, 3, 4, 5, 6, 789012, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    at = send.options(run_at=when, priority=-5, max_attempts=11, lease=42.5).defer_sync(
        sync.target, order_id=1
    )
    later = send.options(delay=timedelta(minutes=2), queue="q").defer_sync(sync.target, 2)
    many = send.options(delay=30).defer_many_sync(sync.target, [{"order_id": 3}])
    now = sync.value("SELECT now()")
    sync.commit()
    rows = {
        r[0]: r[1:]
        for r in other.execute(
            "SELECT id, queue, priority, max_attempts, extract(epoch FROM lease)::float8, run_at"
            " FROM aioq.jobs"
        ).fetchall()
    }
    assert rows[at] == ("default", -5, 11, 42.5, when)
    assert rows[later][:4] == ("q", 0, 5, 30.0)
    assert abs((rows[later][4] - now).total_seconds() - 120) < 1
    assert abs((rows[many[0]][4] - now).total_seconds() - 30) < 1


def test_defaults_take_the_lean_insert_with_the_same_result(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], send: aioq.Task[[int, str], None]
) -> None:
    lean = send.defer_sync(sync.target, order_id=1)
    full = send.options(priority=0, delay=1e-9).defer_sync(sync.target, order_id=1)
    sync.commit()
    rows = other.execute(
        "SELECT priority, max_attempts, extract(epoch FROM lease)::float8 FROM aioq.jobs"
        " WHERE id = ANY(%s) ORDER BY id",
        ([lean, full],),
    ).fetchall()
    assert rows == [TABLE_DEFAULTS, TABLE_DEFAULTS]


# --- unique keys --------------------------------------------------------------------------


def test_unique_key_returns_the_live_job_and_a_rollback_frees_it(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], send: aioq.Task[[int, str], None]
) -> None:
    keyed = send.options(unique_key="order-1")
    rolled_back = keyed.defer_sync(sync.target, order_id=1)
    sync.rollback()
    first = keyed.defer_sync(sync.target, order_id=1)
    assert first != rolled_back
    assert keyed.defer_sync(sync.target, order_id=2, note="other args") == first
    sync.commit()
    assert keyed.defer_sync(sync.target, order_id=3) == first
    other.execute("UPDATE aioq.jobs SET status = 'dead' WHERE id = %s", (first,))
    second = keyed.defer_sync(sync.target, order_id=4)
    sync.commit()
    assert second != first
    assert other.execute("SELECT id, status FROM aioq.jobs ORDER BY id").fetchall() == [
        (first, "dead"),
        (second, "pending"),
    ]


def test_unique_key_inside_a_rolled_back_savepoint(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], send: aioq.Task[[int, str], None]
) -> None:
    keyed = send.options(unique_key="k")
    sync.sql("SAVEPOINT sp")
    rolled = keyed.defer_sync(sync.target, order_id=1)
    sync.sql("ROLLBACK TO SAVEPOINT sp")
    kept = keyed.defer_sync(sync.target, order_id=2)
    sync.sql("SAVEPOINT again")
    assert keyed.defer_sync(sync.target, order_id=3) == kept
    sync.sql("RELEASE SAVEPOINT again")
    sync.commit()
    assert kept != rolled
    assert other.execute("SELECT id FROM aioq.jobs").fetchall() == [(kept,)]


def test_defer_many_refuses_a_unique_key(sync: Sync, send: aioq.Task[[int, str], None]) -> None:
    with pytest.raises(aioq.errors.DeferError, match="unique_key") as info:
        send.options(unique_key="k").defer_many_sync(sync.target, [{"order_id": 1}])
    assert info.value.task_name == send.name
    assert sync.value("SELECT count(*) FROM aioq.jobs") == 0


def test_a_unique_key_longer_than_its_index_holds_is_refused_before_any_sql(
    sync: Sync, send: aioq.Task[[int, str], None]
) -> None:
    """As in tests/test_defer.py: refused by options(), and the caller's transaction goes on."""
    from aioq.options import MAX_UNIQUE_KEY

    sync.value("SELECT 1")  # the caller's transaction is open
    for key in ("k" * 8000, "k" * (MAX_UNIQUE_KEY + 1)):
        with pytest.raises(aioq.errors.OptionError, match=f"at most {MAX_UNIQUE_KEY} characters"):
            send.options(unique_key=key).defer_sync(sync.target, order_id=1)
    kept = send.options(unique_key="k" * MAX_UNIQUE_KEY).defer_sync(sync.target, order_id=1)
    sync.commit()
    assert sync.sql("SELECT id FROM aioq.jobs") == [(kept,)]


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "path"),
    [
        pytest.param(object(), "payload", id="object"),
        pytest.param((1, 2), "payload", id="tuple"),
        pytest.param({"a": [1, {"b": b"x"}]}, "payload['a'][1]['b']", id="nested"),
        pytest.param(math.nan, "payload", id="nan"),
        pytest.param(2**70, "payload", id="int-2**70"),
        pytest.param("a\x00b", "payload", id="nul-in-str"),
        pytest.param(datetime(2031, 1, 1, tzinfo=UTC), "payload", id="datetime"),
    ],
)
def test_unserialisable_argument_raises_before_anything_is_written(
    sync: Sync, registry: aioq.Registry, value: object, path: str
) -> None:
    @registry.task
    def store_it(payload: object, n: int = 0) -> None: ...

    store_it.defer_sync(sync.target, payload="fine")
    with pytest.raises(aioq.errors.SerializationError) as info:
        store_it.defer_sync(sync.target, n=1, payload=value)
    with pytest.raises(aioq.errors.SerializationError):
        store_it.defer_many_sync(sync.target, [{"payload": 1}, {"payload": value}])
    # The caller's transaction is untouched and still usable.
    store_it.defer_sync(sync.target, payload="also fine")
    assert sync.value("SELECT count(*) FROM aioq.jobs") == 2
    assert (info.value.task_name, info.value.argument) == (store_it.name, path)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        pytest.param((), {}, id="missing"),
        pytest.param((), {"order_id": 1, "bogus": 2}, id="extra"),
        pytest.param((1, "x", "y"), {}, id="too-many-positional"),
        pytest.param((1,), {"order_id": 1}, id="twice"),
        pytest.param(("1",), {}, id="wrong-type"),
    ],
)
def test_wrong_arguments_raise_argument_error_before_anything_is_written(
    sync: Sync,
    send: aioq.Task[[int, str], None],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> None:
    defer: Any = send.defer_sync  # deliberately wrong calls: bypass the static check
    with pytest.raises(aioq.ArgumentError) as info:
        defer(sync.target, *args, **kwargs)
    if not args:
        with pytest.raises(aioq.ArgumentError):
            send.defer_many_sync(sync.target, [{"order_id": 1}, kwargs])
    assert sync.value("SELECT count(*) FROM aioq.jobs") == 0
    assert info.value.task_name == send.name


def test_bad_options_raise_before_anything_is_written(send: aioq.Task[[int, str], None]) -> None:
    with pytest.raises(aioq.errors.OptionError, match="run_at"):
        send.options(run_at=datetime(2031, 1, 1))  # naive: the same check as defer's


def test_valid_arguments_round_trip_exactly(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], registry: aioq.Registry
) -> None:
    @registry.task
    def echo(**values: object) -> None: ...

    job_id = echo.defer_sync(sync.target, **ROUND_TRIP_VALUES)
    [many_id] = echo.defer_many_sync(sync.target, [ROUND_TRIP_VALUES])
    sync.commit()
    for stored_id in (job_id, many_id):
        row = other.execute("SELECT args::text FROM aioq.jobs WHERE id = %s", (stored_id,))
        back = orjson.loads(row.fetchone()[0])  # type: ignore[index]
        assert back == ROUND_TRIP_VALUES
        assert same_types(back, ROUND_TRIP_VALUES)


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        pytest.param("postgresql://", "builtins.str", id="a-dsn"),
        pytest.param(object(), "builtins.object", id="an-object"),
    ],
)
def test_a_connection_aioq_cannot_use_is_a_config_error(
    target: object, fragment: str, send: aioq.Task[[int, str], None]
) -> None:
    with pytest.raises(aioq.errors.ConfigError, match=fragment):
        send.defer_sync(target, order_id=1)  # type: ignore[arg-type]


def test_sqlalchemy_on_another_dialect_or_an_engine_is_refused(
    dsn: str, send: aioq.Task[[int, str], None], tmp_path: Any
) -> None:
    lite = sqlalchemy.create_engine(f"sqlite:///{tmp_path}/x.db")
    with Session(lite) as session, pytest.raises(aioq.errors.ConfigError, match="sqlite"):
        send.defer_sync(session, order_id=1)
    engine = _engine(dsn)
    try:
        with pytest.raises(aioq.errors.ConfigError, match="Engine"):
            send.defer_sync(engine, order_id=1)  # type: ignore[arg-type]
    finally:
        engine.dispose()
        lite.dispose()


def test_an_async_psycopg_connection_is_refused(
    dsn: str, send: aioq.Task[[int, str], None]
) -> None:
    import anyio

    async def attempt() -> None:
        conn = await psycopg.AsyncConnection.connect(dsn)
        try:
            with pytest.raises(aioq.errors.ConfigError, match="AsyncConnection"):
                send.defer_sync(conn, order_id=1)  # type: ignore[arg-type]
        finally:
            await conn.close()

    anyio.run(attempt)


# --- the admin functions ------------------------------------------------------------------


def test_get_cancel_and_result_from_sync_code(
    sync: Sync, registry: aioq.Registry, send: aioq.Task[[int, str], None]
) -> None:
    a = send.defer_sync(sync.target, order_id=1)
    b = send.options(unique_key="b").defer_sync(sync.target, order_id=2)
    sync.commit()
    job = aioq.admin.get_job_sync(sync.target, b)
    assert job is not None
    assert (job.status, job.unique_key, orjson.loads(job.args)) == (
        "pending",
        "b",
        {"order_id": 2},
    )
    assert aioq.admin.get_job_sync(sync.target, 10**9) is None
    assert aioq.admin.cancel_jobs_sync(sync.target, [a, a, 10**9]) == {
        a: "cancelled",
        10**9: "missing",
    }
    assert aioq.admin.cancel_jobs_sync(sync.target, [a]) == {a: "cancelled"}  # idempotent
    sync.commit()
    with pytest.raises(aioq.JobCancelled):
        aioq.result_sync(sync.target, a, timeout=1)
    with pytest.raises(aioq.ResultTimeout) as info:
        aioq.result_sync(sync.target, b, timeout=0.2)
    assert info.value.status == "pending"
    with pytest.raises(aioq.ResultMissing):
        aioq.result_sync(sync.target, 10**9, timeout=1)
    with pytest.raises(aioq.errors.ConfigError, match="timeout"):
        aioq.result_sync(sync.target, b, timeout=-1)
    # An id past bigint names no job, as any absent id (the driver would refuse it).
    assert aioq.admin.get_job_sync(sync.target, 2**63) is None
    assert aioq.admin.cancel_jobs_sync(sync.target, [2**63, -(2**63) - 1]) == {
        -(2**63) - 1: "missing",
        2**63: "missing",
    }
    with pytest.raises(aioq.ResultMissing):
        aioq.result_sync(sync.target, 2**63, timeout=1)


@pytest.mark.anyio
async def test_result_sync_returns_what_a_worker_stored(
    dsn: str, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    import anyio

    @registry.task(result_ttl=60)
    def add(a: int, b: int) -> dict[str, int]:
        return {"sum": a + b}

    @registry.task(result_ttl=60, max_attempts=1)
    def broken() -> None:
        raise ValueError("no good")

    with psycopg.connect(dsn, autocommit=True) as conn:
        job_id = add.defer_sync(conn, a=2, b=3)
        failed = broken.defer_sync(conn)

        def wait_both() -> object:
            with pytest.raises(aioq.JobFailed, match="no good"):
                aioq.result_sync(conn, failed, timeout=30)
            return aioq.result_sync(conn, job_id, timeout=30)

        async with make_worker():
            assert await anyio.to_thread.run_sync(wait_both) == {"sum": 5}


def test_result_sync_in_the_job_s_own_uncommitted_transaction_says_so(
    sync: Sync, send: aioq.Task[[int, str], None], caplog: pytest.LogCaptureFixture
) -> None:
    # Deferred and awaited in one transaction: no worker can see the job before the commit.
    job_id = send.defer_sync(sync.target, order_id=1)
    with pytest.raises(aioq.ResultTimeout, match="deferred in the transaction that waits for it"):
        aioq.result_sync(sync.target, job_id, timeout=0.2)
    assert [r.levelname for r in caplog.records if r.name == "aioq.results"] == ["WARNING"]
    sync.commit()
    # Committed, then awaited in a transaction that wrote something else: a plain timeout.
    sync.sql("CREATE TEMP TABLE scratch (x int)")  # this transaction now has an xid
    with pytest.raises(aioq.ResultTimeout) as info:
        aioq.result_sync(sync.target, job_id, timeout=0.2)
    assert str(info.value) == f"job {job_id} is still pending after 0.2s"
    sync.rollback()


def test_workflow_defers_in_the_callers_transaction(
    sync: Sync, other: psycopg.Connection[tuple[Any, ...]], registry: aioq.Registry
) -> None:
    @registry.task(queue="orders")
    def step(n: int) -> None: ...

    flow = aioq.Workflow("sync")
    first = flow.add(step.call(n=1))
    flow.add(step.options(delay=30).call(n=2), after=[first], name="second")
    run = flow.defer_sync(sync.target)
    assert count(other) == 0
    sync.rollback()
    assert sync.value("SELECT count(*) FROM aioq.workflow_steps") == 0
    run = flow.defer_sync(sync.target)
    sync.commit()
    rows = other.execute(
        "SELECT id, status, queue, workflow_id FROM aioq.jobs ORDER BY id"
    ).fetchall()
    assert rows == [
        (run.jobs["step"], "pending", "orders", run.id),
        (run.jobs["second"], "waiting", "orders", run.id),
    ]


# A meta path finder that makes greenlet and SQLAlchemy's asyncio extension look uninstalled
# (SQLAlchemy 2.1 no longer installs greenlet; its asyncio extension needs it).
WITHOUT_ASYNC_EXTRAS = """
import sys

BLOCKED = ("greenlet", "sqlalchemy.ext.asyncio")


class Uninstalled:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, Uninstalled())
import sqlalchemy
from sqlalchemy.orm import Session

import aioq

registry = aioq.Registry()


@registry.task(name="send", queue="mail")
def send(order_id: int) -> None: ...


engine = sqlalchemy.create_engine(sys.argv[1].replace("postgresql://", "postgresql+psycopg://"))
with Session(engine) as session, session.begin():
    in_session = send.defer_sync(session, order_id=1)
with engine.connect() as conn, conn.begin():
    in_connection = send.defer_sync(conn, order_id=2)
with Session(engine) as session:
    shown = aioq.admin.get_job_sync(session, in_session)
    assert shown is not None and shown.queue == "mail", shown
    session.rollback()
loaded = [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]
assert not loaded, loaded
print(in_session, in_connection)
"""


def test_defer_sync_on_sqlalchemy_needs_no_async_extras(
    dsn: str, other: psycopg.Connection[tuple[Any, ...]]
) -> None:
    """A sync Session or Connection defers with neither greenlet nor sqlalchemy.ext.asyncio
    importable, as SQLAlchemy 2.1 installs without greenlet."""
    ran = subprocess.run(
        [sys.executable, "-c", WITHOUT_ASYNC_EXTRAS, dsn],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    ids = [int(i) for i in ran.stdout.split()]
    rows = other.execute(
        "SELECT task, queue, args->>'order_id' FROM aioq.jobs WHERE id = ANY(%s) ORDER BY id",
        (ids,),
    ).fetchall()
    assert rows == [("send", "mail", "1"), ("send", "mail", "2")]
