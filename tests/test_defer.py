"""Deferring jobs: transactional enqueue, the doorbell, options, unique keys, bad input, typing."""

from __future__ import annotations

import math
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import asyncpg
import orjson
import pytest
import statements
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

import aioq
from aioq.sql.jobs import INSERT_JOB, TABLE_DEFAULTS, InsertJob

pytestmark = pytest.mark.anyio

TYPING = Path(__file__).parent / "typing"
NOTIFY_TIMEOUT = 10.0


async def count_jobs(conn: asyncpg.Connection, queue: str | None = None) -> int:
    """Return the number of rows in aioq.jobs (of one queue, if given)."""
    count = await conn.fetchval(
        "SELECT count(*) FROM aioq.jobs WHERE $1::text IS NULL OR queue = $1", queue
    )
    return int(count)


@pytest.fixture
def send(registry: aioq.Registry) -> aioq.Task[[int, str], None]:
    """A task with one required and one optional argument."""

    @registry.task
    async def send(order_id: int, note: str = "") -> None:
        """Send an order confirmation."""

    return send


@pytest.fixture
def ping(registry: aioq.Registry) -> aioq.Task[[], None]:
    """A task without arguments, used as a sentinel."""

    @registry.task
    async def ping() -> None:
        """Do nothing."""

    return ping


WATCHED = ("sentinel", "rolled-back", "three", "many", "mixed-a", "mixed-b", "later")


class Doorbells:
    """The payloads (queue names) delivered on the ``aioq:aioq`` channel to a second connection."""

    def __init__(self) -> None:
        self._send: MemoryObjectSendStream[str]
        self._receive: MemoryObjectReceiveStream[str]
        self._send, self._receive = anyio.create_memory_object_stream[str](math.inf)

    def on_notify(self, conn: object, pid: int, channel: str, payload: str) -> None:
        self._send.send_nowait(payload)

    async def until(self, sentinel: str) -> list[str]:
        """Return every payload received before ``sentinel`` (which must arrive in time)."""
        seen: list[str] = []
        with anyio.fail_after(NOTIFY_TIMEOUT):
            async for payload in self._receive:
                if payload == sentinel:
                    return seen
                seen.append(payload)
        raise AssertionError("the notification stream closed")  # pragma: no cover

    def close(self) -> None:
        self._send.close()
        self._receive.close()


@pytest.fixture
async def doorbells(dsn: str) -> AsyncIterator[Doorbells]:
    """Listen on the default schema's channel from a connection of its own, waiting as a worker.

    The doorbell rings only for queues a worker waits on (docs/architecture.md, "The doorbell"): this connection arms
    it for the queues these tests use, as a worker about to sleep does.
    """
    bells = Doorbells()
    listener = await asyncpg.connect(dsn)
    try:
        await listener.add_listener("aioq:aioq", bells.on_notify)
        await statements.arm(listener, WATCHED)
        yield bells
    finally:
        await listener.close()
        bells.close()


async def ring_sentinel(conn: asyncpg.Connection, ping: aioq.Task[[], None]) -> None:
    """Commit a job on the ``sentinel`` queue: its notification comes after all earlier ones."""
    await ping.options(queue="sentinel").defer(conn)


# --- transactional enqueue ----------------------------------------------------------------


async def test_defer_in_committed_transaction_writes_the_row(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(queue="orders", priority=4, max_attempts=9)
    async def charge(order_id: int, amount: float, tags: list[str]) -> None: ...

    async with conn.transaction():
        job_id = await charge.defer(conn, order_id=7, amount=12.5, tags=["a", "b"])
    row = await conn.fetchrow(
        "SELECT *, args::text AS args_text FROM aioq.jobs WHERE id = $1", job_id
    )
    assert row is not None
    assert (row["queue"], row["task"], row["priority"], row["max_attempts"]) == (
        "orders",
        charge.name,
        4,
        9,
    )
    assert orjson.loads(row["args_text"]) == {"order_id": 7, "amount": 12.5, "tags": ["a", "b"]}
    assert (row["status"], row["attempts"], row["locked_by"], row["unique_key"]) == (
        "pending",
        0,
        None,
        None,
    )


async def test_rolled_back_defer_writes_nothing_and_rings_nothing(
    conn: asyncpg.Connection,
    send: aioq.Task[[int, str], None],
    ping: aioq.Task[[], None],
    doorbells: Doorbells,
) -> None:
    tx = conn.transaction()
    await tx.start()
    await send.options(queue="rolled-back").defer(conn, order_id=1)
    await tx.rollback()

    await ring_sentinel(conn, ping)
    assert await doorbells.until("sentinel") == []
    assert await count_jobs(conn, "rolled-back") == 0


async def test_one_notification_per_queue_per_transaction(
    conn: asyncpg.Connection,
    send: aioq.Task[[int, str], None],
    ping: aioq.Task[[], None],
    doorbells: Doorbells,
) -> None:
    async with conn.transaction():
        for order_id in range(3):
            await send.options(queue="three").defer(conn, order_id=order_id)
    async with conn.transaction():
        await send.options(queue="many").defer_many(conn, [{"order_id": i} for i in range(100)])
    async with conn.transaction():
        await send.options(queue="mixed-a").defer(conn, order_id=1)
        await send.options(queue="mixed-b").defer(conn, order_id=2)
        await send.options(queue="mixed-a").defer_many(conn, [{"order_id": 3}, {"order_id": 4}])
    # A delayed job is not ready: the doorbell stays silent for it.
    await send.options(queue="later", delay=3600).defer(conn, order_id=5)

    await ring_sentinel(conn, ping)
    seen = await doorbells.until("sentinel")
    assert sorted(seen) == ["many", "mixed-a", "mixed-b", "three"]
    assert seen.index("three") < seen.index("many") < seen.index("mixed-a")


async def test_autocommit_defer_is_visible_at_once(
    conn: asyncpg.Connection, dsn: str, send: aioq.Task[[int, str], None]
) -> None:
    assert not conn.is_in_transaction()
    job_id = await send.defer(conn, order_id=1)
    other = await asyncpg.connect(dsn)
    try:
        assert await other.fetchval("SELECT task FROM aioq.jobs WHERE id = $1", job_id) == send.name
    finally:
        await other.close()


async def test_rolled_back_savepoint_keeps_the_outer_transactions_jobs(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    async with conn.transaction():
        kept = await send.defer(conn, order_id=1)
        savepoint = conn.transaction()  # nested: a SAVEPOINT
        await savepoint.start()
        await send.defer(conn, order_id=2)
        await send.defer_many(conn, [{"order_id": 3}])
        await savepoint.rollback()
        assert conn.is_in_transaction()
        also_kept = await send.defer(conn, order_id=4)
    ids = await conn.fetch("SELECT id FROM aioq.jobs ORDER BY id")
    assert [r["id"] for r in ids] == [kept, also_kept]


async def test_defer_uses_the_callers_connection_and_never_commits(
    conn: asyncpg.Connection, dsn: str, send: aioq.Task[[int, str], None]
) -> None:
    backends = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    other = await asyncpg.connect(dsn)
    try:
        before = await other.fetchval(backends)
        async with conn.transaction():
            job_id = await send.defer(conn, order_id=1)
            [many_id] = await send.defer_many(conn, [{"order_id": 2}])
            assert conn.is_in_transaction()
            assert await other.fetchval(backends) == before
            assert await other.fetchval("SELECT count(*) FROM aioq.jobs") == 0
            assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 2
        found = await other.fetch("SELECT id FROM aioq.jobs ORDER BY id")
        assert [r["id"] for r in found] == [job_id, many_id]
    finally:
        await other.close()


async def test_defer_many_is_one_statement_in_the_callers_transaction(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    calls = [{"order_id": i, "note": f"n{i}"} for i in range(10_000)]
    logged: list[str] = []

    def log(record: Any) -> None:
        logged.append(record.query)

    async with conn.transaction():
        conn.add_query_logger(log)
        try:
            ids = await send.defer_many(conn, calls)
        finally:
            conn.remove_query_logger(log)
        # asyncpg hands records to loggers with call_soon: one checkpoint delivers them all.
        await anyio.lowlevel.checkpoint()
        assert len(logged) == 1, logged
    assert len(ids) == len(set(ids)) == 10_000
    assert ids == sorted(ids)
    rows = await conn.fetch("SELECT id, (args->>'order_id')::int AS n FROM aioq.jobs ORDER BY id")
    assert [(r["id"], r["n"]) for r in rows] == list(zip(ids, range(10_000), strict=True))

    tx = conn.transaction()
    await tx.start()
    await send.options(queue="gone").defer_many(conn, calls)
    await tx.rollback()
    assert await count_jobs(conn) == 10_000


async def test_defer_many_of_nothing_writes_nothing(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    assert await send.defer_many(conn, []) == []
    assert await count_jobs(conn) == 0


# --- options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("delay", "seconds"),
    [(30.0, 30.0), (5, 5.0), (timedelta(minutes=2), 120.0), (timedelta(0), 0.0)],
)
async def test_delay_sets_run_at_in_database_time(
    conn: asyncpg.Connection,
    send: aioq.Task[[int, str], None],
    delay: float | timedelta,
    seconds: float,
) -> None:
    async with conn.transaction():
        now = await conn.fetchval("SELECT now()")
        job_id = await send.options(delay=delay).defer(conn, order_id=1)
        run_at = await conn.fetchval("SELECT run_at FROM aioq.jobs WHERE id = $1", job_id)
    assert seconds - 0.5 <= (run_at - now).total_seconds() <= seconds + 0.5


async def test_run_at_is_stored_exactly(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    when = datetime(2031, 2, 3, 4, 5, 6, 789012, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    job_id = await send.options(run_at=when).defer(conn, order_id=1)
    assert await conn.fetchval("SELECT run_at FROM aioq.jobs WHERE id = $1", job_id) == when


async def test_bad_time_options_raise_config_error(send: aioq.Task[[int, str], None]) -> None:
    with pytest.raises(aioq.errors.ConfigError, match="run_at"):
        send.options(run_at=datetime(2031, 1, 1))  # naive
    with pytest.raises(aioq.errors.ConfigError, match="run_at"):
        send.options(delay=5, run_at=datetime(2031, 1, 1, tzinfo=UTC))
    with pytest.raises(aioq.errors.ConfigError, match="delay"):
        send.options(delay=-1)
    with pytest.raises(aioq.errors.ConfigError, match="delay"):
        send.options(delay="5")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [{"priority": 2**31}, {"max_attempts": 0}, {"lease": 0}, {"queue": ""}, {"queue": "q" * 201}],
    ids=repr,
)
def test_out_of_range_options_raise_config_error(
    send: aioq.Task[[int, str], None], options: dict[str, Any]
) -> None:
    with pytest.raises(aioq.errors.ConfigError, match=next(iter(options))):
        send.options(**options)


async def test_options_are_stored_and_leave_the_task_defaults_alone(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(queue="q-default", priority=1, max_attempts=2, lease=3.0)
    async def work(n: int) -> None: ...

    defaults = work.defaults
    custom = work.options(queue="q-custom", priority=-5, max_attempts=11, lease=42.5)
    custom_id = await custom.defer(conn, n=1)
    default_id = await work.defer(conn, n=2)
    [many_id] = await custom.defer_many(conn, [{"n": 3}])

    assert work.defaults == defaults
    assert (work.defaults.queue, work.defaults.priority) == ("q-default", 1)
    rows = {
        r["id"]: tuple(r.values())[1:]
        for r in await conn.fetch("SELECT id, queue, priority, max_attempts, lease FROM aioq.jobs")
    }
    assert rows[custom_id] == rows[many_id] == ("q-custom", -5, 11, timedelta(seconds=42.5))
    assert rows[default_id] == ("q-default", 1, 2, timedelta(seconds=3))


# --- unique keys --------------------------------------------------------------------------


async def test_unique_key_returns_the_live_job(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    keyed = send.options(unique_key="order-1")
    first = await keyed.defer(conn, order_id=1)
    assert await keyed.defer(conn, order_id=1) == first
    async with conn.transaction():
        assert await keyed.defer(conn, order_id=2, note="other args") == first
    assert await count_jobs(conn) == 1

    # A running job still holds its key.
    [claimed] = await statements.claim(conn, ["default"], 1, "worker-1")
    assert claimed.id == first
    assert await keyed.defer(conn, order_id=1) == first
    assert await count_jobs(conn) == 1


async def test_unique_key_is_free_again_once_the_job_is_dead_or_gone(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    keyed = send.options(unique_key="order-1")
    first = await keyed.defer(conn, order_id=1)
    await conn.execute("UPDATE aioq.jobs SET status = 'dead' WHERE id = $1", first)
    second = await keyed.defer(conn, order_id=1)
    assert second != first
    assert await count_jobs(conn) == 2

    await conn.execute("DELETE FROM aioq.jobs WHERE id = $1", second)
    third = await keyed.defer(conn, order_id=1)
    assert third not in (first, second)
    statuses = await conn.fetch("SELECT id, status FROM aioq.jobs ORDER BY id")
    assert [tuple(r) for r in statuses] == [(first, "dead"), (third, "pending")]


async def test_unique_key_rolled_back_leaves_the_key_free(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    keyed = send.options(unique_key="k")
    tx = conn.transaction()
    await tx.start()
    rolled_back = await keyed.defer(conn, order_id=1)
    await tx.rollback()
    kept = await keyed.defer(conn, order_id=1)
    assert kept != rolled_back
    assert await count_jobs(conn) == 1


async def test_defer_many_refuses_a_unique_key(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    with pytest.raises(aioq.errors.DeferError, match="unique_key") as info:
        await send.options(unique_key="k").defer_many(conn, [{"order_id": 1}])
    assert info.value.task_name == send.name
    assert await count_jobs(conn) == 0


def incompressible_key(length: int) -> str:
    """A key of ``length`` random characters of four UTF-8 bytes each: the longest text of that
    many characters, which no compression shortens (the index stores it as it is)."""
    return "".join(chr(0x10000 + secrets.randbelow(0xF0000)) for _ in range(length))


async def test_a_unique_key_longer_than_its_index_holds_is_refused_before_any_sql(
    conn: asyncpg.Connection, send: aioq.Task[[int, str], None]
) -> None:
    """A unique_key of 8 000 characters reached the database, whose unique index refused it
    (an entry holds at most 2 692 bytes of text) and aborted the caller's transaction. Keys are
    bounded like queue names: MAX_UNIQUE_KEY characters, whatever their bytes, fit; one more is
    refused by options(), on every path, before any SQL."""
    from aioq.options import MAX_UNIQUE_KEY

    async with conn.transaction():
        longest = incompressible_key(MAX_UNIQUE_KEY)
        first = await send.options(unique_key=longest).defer(conn, order_id=1)
        assert await send.options(unique_key=longest).defer(conn, order_id=2) == first
        windowed = incompressible_key(MAX_UNIQUE_KEY)  # also the uniques table's primary key
        await send.options(unique_key=windowed, unique_for=60).defer(conn, order_id=3)
    assert await count_jobs(conn) == 2

    too_long = secrets.token_hex(4000)  # 8 000 characters
    one_more = "k" * (MAX_UNIQUE_KEY + 1)
    paths = {
        "defer": lambda key: send.options(unique_key=key).defer(conn, order_id=1),
        "replace": lambda key: send.options(unique_key=key, on_conflict="replace").defer(
            conn, order_id=1
        ),
        "unique_for": lambda key: send.options(unique_key=key, unique_for=60).defer(
            conn, order_id=1
        ),
        "defer_many": lambda key: send.options(unique_key=key).defer_many(conn, [{"order_id": 1}]),
        "workflow step": lambda key: aioq.chain(
            send.options(unique_key=key).call(order_id=1)
        ).defer(conn),
    }
    async with conn.transaction():
        for path, defer in paths.items():
            for key in (too_long, one_more):
                with pytest.raises(aioq.errors.OptionError) as info:
                    await defer(key)
                assert info.value.field == "unique_key", path
                assert f"at most {MAX_UNIQUE_KEY} characters" in str(info.value), path
                assert str(len(key)) in str(info.value), path
                assert len(str(info.value)) < 400, path  # the key itself is not repeated
                # The caller's transaction is still usable.
                assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 2, path


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "path"),
    [
        pytest.param(object(), "payload", id="object"),
        pytest.param({1, 2}, "payload", id="set"),
        pytest.param(b"bytes", "payload", id="bytes"),
        pytest.param(datetime(2031, 1, 1, tzinfo=UTC), "payload", id="datetime"),
        pytest.param((1, 2), "payload", id="tuple"),
        pytest.param({"a": [1, {"b": object()}]}, "payload['a'][1]['b']", id="nested"),
        pytest.param([1, 2, (3,)], "payload[2]", id="tuple-in-list"),
        pytest.param(math.nan, "payload", id="nan"),
        pytest.param(math.inf, "payload", id="inf"),
        pytest.param({"x": -math.inf}, "payload['x']", id="nested-minus-inf"),
        pytest.param(2**70, "payload", id="int-2**70"),
        pytest.param(-(2**63) - 1, "payload", id="int-below-int64"),
        pytest.param("a\x00b", "payload", id="nul-in-str"),
        pytest.param({"a\x00": 1}, "payload key 'a\\x00'", id="nul-in-key"),
        pytest.param({1: "x"}, "payload[1]", id="int-key"),
        pytest.param("\ud800", "payload", id="lone-surrogate"),
        pytest.param(["ok", {"s": "\udfff"}], "payload", id="nested-lone-surrogate"),
    ],
)
async def test_unserialisable_argument_raises_before_anything_is_written(
    conn: asyncpg.Connection, registry: aioq.Registry, value: object, path: str
) -> None:
    @registry.task
    async def store_it(payload: object, n: int = 0) -> None: ...

    async with conn.transaction():
        await store_it.defer(conn, payload="fine")
        with pytest.raises(aioq.errors.SerializationError) as info:
            await store_it.defer(conn, n=1, payload=value)
        with pytest.raises(aioq.errors.SerializationError):
            await store_it.defer_many(conn, [{"payload": 1}, {"payload": value}, {"payload": 2}])
        # The caller's transaction is untouched and still usable.
        assert await count_jobs(conn) == 1
        await store_it.defer(conn, payload="also fine")
    assert await count_jobs(conn) == 2

    error = info.value
    assert isinstance(error, aioq.errors.DeferError)
    assert isinstance(error, aioq.AioqError)
    assert (error.task_name, error.argument) == (store_it.name, path)
    assert repr(store_it.name) in str(error)
    assert repr(path) in str(error)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        pytest.param((), {}, id="missing"),
        pytest.param((), {"note": "x"}, id="missing-with-optional"),
        pytest.param((), {"order_id": 1, "bogus": 2}, id="extra"),
        pytest.param((), {"orderid": 1}, id="misspelt"),
        pytest.param((1, "x", "y"), {}, id="too-many-positional"),
        pytest.param((1,), {"order_id": 1}, id="twice"),
    ],
)
async def test_wrong_arguments_raise_argument_error_before_anything_is_written(
    conn: asyncpg.Connection,
    send: aioq.Task[[int, str], None],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> None:
    defer: Any = send.defer  # deliberately wrong calls: bypass the static check
    async with conn.transaction():
        with pytest.raises(aioq.ArgumentError) as info:
            await defer(conn, *args, **kwargs)
        if not args:
            with pytest.raises(aioq.ArgumentError):
                await send.defer_many(conn, [{"order_id": 1}, kwargs])
        assert await conn.fetchval("SELECT 1") == 1
    assert await count_jobs(conn) == 0
    assert isinstance(info.value, aioq.errors.DeferError)
    assert info.value.task_name == send.name
    assert send.name in str(info.value)


ROUND_TRIP_VALUES: dict[str, object] = {
    "nested": {"a": [1, [2, [3, {"b": None}]]], "c": {"d": {"e": []}}},
    "unicode": "héllo wörld ✓ 漢字 😀👍🏽 \u200b \n\t\"'\\",
    "emoji_key": {"😀": "grin", "": "empty key"},
    "int64_max": 2**63 - 1,
    "int64_min": -(2**63),
    "uint64_max": 2**64 - 1,
    "negative": -42,
    "zero": 0,
    "floats": [0.1, 1e-7, -2.5, 1.0, 123456.789, 1e15, 5e-324, 1.7976931348623157e308],
    "bools": [True, False],
    "none": None,
    "empty": [[], {}, ""],
}


async def test_valid_arguments_round_trip_exactly(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def echo(**values: object) -> None: ...

    job_id = await echo.defer(conn, **ROUND_TRIP_VALUES)
    [many_id] = await echo.defer_many(conn, [ROUND_TRIP_VALUES])
    for stored_id in (job_id, many_id):
        text = await conn.fetchval("SELECT args::text FROM aioq.jobs WHERE id = $1", stored_id)
        back = orjson.loads(text)
        assert back == ROUND_TRIP_VALUES
        assert same_types(back, ROUND_TRIP_VALUES)


def same_types(a: object, b: object) -> bool:
    """Whether two equal JSON values also have the same types throughout (1.0 vs 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list) and isinstance(b, list):
        return all(same_types(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return all(same_types(a[k], b[k]) for k in a)
    return True


async def test_every_accepted_float_round_trips_with_its_type(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task
    async def measure(x: float) -> None: ...

    for value in (1e16, -1e16, 1.5e17, 9.2e18, 1e20):
        try:
            job_id = await measure.defer(conn, x=value)
        except aioq.errors.SerializationError:
            continue  # refusing it is fine too: nothing changes silently
        text = await conn.fetchval("SELECT args::text FROM aioq.jobs WHERE id = $1", job_id)
        back = orjson.loads(text)["x"]
        assert type(back) is float, f"{value!r} came back as {back!r}"


# --- registration -------------------------------------------------------------------------


def test_star_args_and_positional_only_are_refused_at_registration(
    registry: aioq.Registry,
) -> None:
    def star(*items: int) -> None: ...

    def positional(a: int, /, b: int) -> None: ...

    for fn in (star, positional):
        with pytest.raises(aioq.errors.ConfigError, match="keyword"):
            registry.task(fn)
    assert len(registry) == 0


def test_default_task_name_is_module_and_qualname(registry: aioq.Registry) -> None:
    async def send_mail(to: str) -> None: ...

    registered = registry.task(send_mail)
    assert (
        registered.name
        == f"{__name__}.test_default_task_name_is_module_and_qualname.<locals>.send_mail"
    )
    assert registry.get(registered.name) is registered


def test_a_taken_name_refuses_a_different_function(registry: aioq.Registry) -> None:
    def first() -> None: ...

    def second() -> None: ...

    registered = registry.task(name="jobs.cleanup")(first)
    assert registry.task(name="jobs.cleanup")(first).fn is first  # same function: fine
    with pytest.raises(aioq.errors.ConfigError, match=r"jobs\.cleanup"):
        registry.task(name="jobs.cleanup")(second)
    assert registry.get("jobs.cleanup") is not None
    assert registry.get("jobs.cleanup").fn is registered.fn  # type: ignore[union-attr]


# --- static typing ------------------------------------------------------------------------

_EXPECTED = re.compile(r"# error: \[([a-z-]+)\]")
_REPORTED = re.compile(r"^[^:]+:(\d+): error: .*\[([a-z-]+)\]$")


def expected_errors(path: Path) -> set[tuple[int, str]]:
    """The (line, error code) pairs marked ``# error: [code]`` in a file."""
    found = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _EXPECTED.search(line)
        if match:
            found.add((number, match.group(1)))
    return found


@pytest.fixture(scope="module")
def mypy_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run mypy --strict once per file, both at the same time, each with a cache of its own."""
    processes = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mypy",
                "--strict",
                "--follow-imports=silent",
                "--no-error-summary",
                "--show-error-codes",
                "--cache-dir",
                str(tmp_path_factory.mktemp(f"mypy-{name}")),
                str(TYPING / f"{name}.py"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=TYPING.parent.parent,
        )
        for name in ("good_defer", "bad_defer")
    }
    results = {}
    try:
        for name, process in processes.items():
            # A hang guard, not a timing: mypy on a loaded machine takes minutes.
            out, err = process.communicate(timeout=900)
            results[name] = (process.returncode, out, err)
    finally:
        for process in processes.values():  # none left running if one timed out
            if process.poll() is None:
                process.kill()
                process.communicate()
    return results


def test_mypy_accepts_good_defer_calls(mypy_results: dict[str, Any]) -> None:
    returncode, out, err = mypy_results["good_defer"]
    assert (returncode, out) == (0, ""), out + err


def test_mypy_rejects_bad_defer_calls(mypy_results: dict[str, Any]) -> None:
    returncode, out, err = mypy_results["bad_defer"]
    assert returncode == 1, out + err
    reported = set()
    for line in out.splitlines():
        match = _REPORTED.match(line)
        if match:
            reported.add((int(match.group(1)), match.group(2)))
    expected = expected_errors(TYPING / "bad_defer.py")
    assert len(expected) >= 10
    assert reported == expected, out


@pytest.mark.parametrize(
    "changes",
    [
        {"priority": 1},
        {"max_attempts": 4},
        {"lease": 31.0},
        {"delay": 0.5},
        {"run_at": datetime(2031, 1, 1, tzinfo=UTC)},
        {"unique_key": "k"},
    ],
    ids=lambda changes: next(iter(changes)),
)
async def test_any_option_off_its_default_takes_the_full_insert(
    conn: asyncpg.Connection, registry: aioq.Registry, changes: dict[str, Any]
) -> None:
    @registry.task(name="opt")
    async def opt(n: int) -> None: ...

    assert opt.defaults.at_defaults
    call = opt.options(**changes)
    assert not call.opts.at_defaults
    job_id = await call.defer(conn, n=1)
    row = await conn.fetchrow(
        "SELECT priority, max_attempts, extract(epoch FROM lease)::float8 AS lease,"
        " run_at > now() AS later, unique_key FROM aioq.jobs WHERE id = $1",
        job_id,
    )
    expected = {"priority": 0, "max_attempts": 5, "lease": 30.0, "unique_key": None}
    expected.update({k: v for k, v in changes.items() if k in expected})
    assert {k: row[k] for k in expected} == expected
    assert row["later"] == ("delay" in changes or "run_at" in changes)


async def test_the_lean_insert_gives_what_the_full_one_gives(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    """Default options take a three-parameter INSERT; the columns' defaults must match."""

    @registry.task(name="lean")
    async def lean(n: int) -> None: ...

    columns = "priority, max_attempts, extract(epoch FROM lease)::float8, run_at <= now()"
    lean_id = await lean.defer(conn, n=1)  # every option at its default: the lean statement
    # Same values through the full statement (a delay of 0 is not the lean case's "no delay").
    full = InsertJob(
        queue="default",
        task="lean",
        args='{"n": 1}',
        priority=0,
        run_at=None,
        delay=1e-9,
        max_attempts=5,
        lease=30.0,
        traceparent=None,
    )
    full_id = await INSERT_JOB.row(conn, "aioq", full)
    rows = await conn.fetch(f"SELECT id, {columns} FROM aioq.jobs ORDER BY id")
    assert [r["id"] for r in rows] == [lean_id, full_id]
    assert tuple(rows[0])[1:4] == TABLE_DEFAULTS
    assert tuple(rows[0])[1:] == tuple(rows[1])[1:]
    assert lean.defaults.priority == TABLE_DEFAULTS[0]  # the task defaults take the lean path
    assert (lean.defaults.max_attempts, lean.defaults.lease) == TABLE_DEFAULTS[1:]
