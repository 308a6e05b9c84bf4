"""Per-key concurrency: max_running_per_key holds across the fleet, and keys take turns."""

from __future__ import annotations

import collections
import signal
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import asyncpg
import pytest
from procs import aioq_cli, fleet_of, listening
from waits import eventually

import aioq
from aioq.db import Executor
from aioq.errors import ConfigError, OptionError
from aioq.worker.claimer import Claimer

HANG_GUARD = 120.0


def claimer(db: Executor, queues: list[str], worker_id: str = "w") -> Claimer:
    return Claimer(schema="aioq", db=db, queues=queues, worker_id=worker_id, ring=lambda: None)


async def defer_keyed(
    conn: asyncpg.Connection, queue: str, key: str | None, n: int, sleep: float = 0.0
) -> None:
    await conn.execute(
        "INSERT INTO aioq.jobs (queue, task, args, concurrency_key)"
        " SELECT $1, 'nap', jsonb_build_object('sleep', $4::float8), $3"
        " FROM generate_series(1, $2)",
        queue,
        n,
        key,
        sleep,
    )


async def running_per_key(conn: asyncpg.Connection, queue: str) -> dict[str | None, int]:
    rows = await conn.fetch(
        "SELECT concurrency_key, count(*) FROM aioq.jobs WHERE queue = $1 AND status = 'running'"
        " GROUP BY 1",
        queue,
    )
    return {r[0]: r[1] for r in rows}


# --- the API ---


@pytest.mark.anyio
async def test_concurrency_key_is_stored_from_options_or_the_task_function(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(name="sync", concurrency_key=lambda tenant, **_: f"tenant:{tenant}")
    async def sync(tenant: int, full: bool = False) -> None: ...

    @registry.task(name="plain")
    async def plain() -> None: ...

    a = await sync.defer(conn, 42)
    b = await sync.options(concurrency_key="vip").defer(conn, 42)  # options' own comes first
    c = await plain.defer(conn)
    [d, e] = await sync.defer_many(conn, [{"tenant": 1}, {"tenant": 2, "full": True}])
    [f] = await plain.options(concurrency_key="x").defer_many(conn, [{}])
    keys = dict(await conn.fetch("SELECT id, concurrency_key FROM aioq.jobs"))
    assert keys == {a: "tenant:42", b: "vip", c: None, d: "tenant:1", e: "tenant:2", f: "x"}


@pytest.mark.anyio
async def test_bad_keys_and_limits_are_refused_before_anything_is_written(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(name="t", concurrency_key=lambda n: n)
    async def t(n: object) -> None: ...

    for bad in ("", "x" * 201, "a\x00b", 5):
        with pytest.raises(OptionError, match="concurrency_key"):
            t.options(concurrency_key=bad)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=r"concurrency_key.*key function"):
        await t.defer(conn, 7)
    with pytest.raises(ConfigError, match="concurrency_key: 'u': must be a function"):
        registry.task(name="u", concurrency_key="tenant")(lambda: None)  # type: ignore[call-overload]
    for value in (0, -1, 1.5, True, "3"):
        with pytest.raises(ConfigError, match="max_running_per_key: queue 'q': must be an integer"):
            await aioq.admin.set_queue(conn, "q", max_running_per_key=value)  # type: ignore[arg-type]
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
    assert await conn.fetchval("SELECT count(*) FROM aioq.queues") == 0
    info = await aioq.admin.set_queue(conn, "q", max_running_per_key=3)
    assert (info.max_running_per_key, info.max_running) == (3, None)
    info = await aioq.admin.set_queue(conn, "q", max_running=10)  # what is not given stays
    assert (info.max_running_per_key, info.max_running) == (3, 10)
    info = await aioq.admin.set_queue(conn, "q", max_running_per_key=None)
    assert (info.max_running_per_key, info.max_running) == (None, 10)


@pytest.mark.anyio
async def test_the_claim_takes_no_more_than_each_keys_room_and_keys_in_turn(
    conn: asyncpg.Connection,
) -> None:
    # No key: one more group, not limited per key, found among the queue's first 100 jobs.
    await defer_keyed(conn, "t", None, 3)
    await defer_keyed(conn, "t", "big", 500)
    for key in ("a", "b", "c"):
        await defer_keyed(conn, "t", key, 5)
    await aioq.admin.set_queue(conn, "t", max_running_per_key=2)
    gate = claimer(conn, ["t"])
    # A claim of 5: one job of each of the five groups (keys in turn), not five of "big",
    # which holds the oldest jobs.
    first = await gate.claim(5)
    assert len(first) == 5
    assert await running_per_key(conn, "t") == {"big": 1, "a": 1, "b": 1, "c": 1, None: 1}
    # Then each key up to its room of 2; the unkeyed group is not limited per key.
    second = await gate.claim(100)
    assert await running_per_key(conn, "t") == {"big": 2, "a": 2, "b": 2, "c": 2, None: 3}
    assert len(first) + len(second) == 11
    assert await gate.claim(100) == []
    # A job that ends makes room for its own key only.
    done, key = await conn.fetchrow(
        "SELECT id, concurrency_key FROM aioq.jobs WHERE status = 'running' AND concurrency_key"
        " = 'a' LIMIT 1"
    )
    await conn.execute("DELETE FROM aioq.jobs WHERE id = $1", done)
    again = await gate.claim(100)
    assert len(again) == 1
    assert (
        await conn.fetchval("SELECT concurrency_key FROM aioq.jobs WHERE id = $1", again[0].id)
        == key
    )
    # Priority comes first: a higher-priority job of a key with room goes before the turns.
    await conn.execute("UPDATE aioq.queues SET max_running_per_key = 3")
    await conn.execute(
        "UPDATE aioq.jobs SET priority = 5 WHERE id = (SELECT max(id) FROM aioq.jobs"
        " WHERE concurrency_key = 'c' AND status = 'pending')"
    )
    [top] = await gate.claim(1)
    assert (
        top.priority,
        await conn.fetchval("SELECT concurrency_key FROM aioq.jobs WHERE id = $1", top.id),
    ) == (5, "c")


@pytest.mark.anyio
async def test_max_running_and_per_key_limits_hold_together(conn: asyncpg.Connection) -> None:
    for key in ("a", "b", "c", "d"):
        await defer_keyed(conn, "t", key, 10)
    await aioq.admin.set_queue(conn, "t", max_running_per_key=3, max_running=5)
    gate = claimer(conn, ["t"])
    assert len(await gate.claim(100)) == 5
    counts = await running_per_key(conn, "t")
    assert sum(counts.values()) == 5
    assert max(counts.values()) <= 2
    await aioq.admin.set_queue(conn, "t", max_running=None)
    gate.changed()
    assert len(await gate.claim(100)) == 7
    assert await running_per_key(conn, "t") == {"a": 3, "b": 3, "c": 3, "d": 3}


@pytest.mark.anyio
async def test_concurrent_claimers_never_exceed_a_keys_limit(
    dsn: str, conn: asyncpg.Connection
) -> None:
    """16 claimers at once on 4 keys with max_running_per_key=2: 8 claimed, 2 per key."""
    for key in ("a", "b", "c", "d"):
        await defer_keyed(conn, "t", key, 50)
    await aioq.admin.set_queue(conn, "t", max_running_per_key=2)
    pool = await asyncpg.create_pool(dsn, min_size=16, max_size=16)
    try:
        claimed: list[int] = []

        async def claim(i: int) -> None:
            claimed.extend(c.id for c in await claimer(pool, ["t"], f"w{i}").claim(50))

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(claim, i)
    finally:
        await pool.close()
    assert len(claimed) == len(set(claimed)) == 8
    assert await running_per_key(conn, "t") == {"a": 2, "b": 2, "c": 2, "d": 2}


@pytest.mark.anyio
async def test_a_queue_without_keys_runs_the_plain_claim(conn: asyncpg.Connection) -> None:
    """No per-key setting: the keyed statements are never read (the plain claim's plan)."""
    await defer_keyed(conn, "t", "a", 5)
    gate = claimer(conn, ["t"])
    assert len(await gate.claim(100)) == 5  # keys mean nothing without the setting
    await aioq.admin.set_queue(conn, "t", max_running=100)
    await defer_keyed(conn, "t", "a", 5)
    gate.changed()
    assert len(await gate.claim(100)) == 5


# --- real workers ---

NAPPER = textwrap.dedent(
    """
    import asyncio

    import aioq

    registry = aioq.Registry()


    @registry.task(name="nap", lease=1.0)
    async def nap(sleep: float = 0.0) -> None:
        await asyncio.sleep(sleep)
    """
)


@pytest.fixture
def fleet(dsn: str, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    (tmp_path / "napper.py").write_text(NAPPER)
    yield from fleet_of(dsn, tmp_path, "napper:registry")


@pytest.mark.anyio
async def test_small_keys_finish_before_a_large_backlog_across_processes(
    conn: asyncpg.Connection, fleet: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """One key with 3 000 jobs (deferred first), 20 keys with 20 each, max_running_per_key=2,
    2 processes x 10 consumers, 20 ms jobs: every small key's job is done while the big key
    still has most of its backlog, and no key ever runs more than 2 at once."""
    await aioq.admin.set_queue(conn, "t", max_running_per_key=2)
    await defer_keyed(conn, "t", "big", 3000, sleep=0.02)
    for i in range(20):
        await defer_keyed(conn, "t", f"small-{i}", 20, sleep=0.02)
    fleet("--processes", "2", "--concurrency", "10", "--queue", "t")
    worst: dict[str | None, int] = collections.defaultdict(int)
    small_left = "SELECT count(*) FROM aioq.jobs WHERE concurrency_key <> 'big'"
    with anyio.fail_after(HANG_GUARD):
        while await conn.fetchval(small_left):
            for key, n in (await running_per_key(conn, "t")).items():
                worst[key] = max(worst[key], n)
            await anyio.sleep(0.01)
    big_left = await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE concurrency_key = 'big'")
    print(f"\nsmall keys done; big key has {big_left} of 3000 left; most running per key {worst}")
    assert big_left > 2000
    assert max(worst.values()) <= 2


@pytest.mark.anyio
async def test_per_key_limit_survives_a_killed_worker(
    conn: asyncpg.Connection, fleet: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """Two workers on 1 s leases, one SIGKILLed mid-run: its claims are reaped and run again,
    every job runs, and no key runs more than 2 at once (the dead worker's expired claims
    count until reaped)."""
    await aioq.admin.set_queue(conn, "t", max_running_per_key=2)
    for i in range(5):
        await defer_keyed(conn, "t", f"k{i}", 20, sleep=0.1)
    victim = fleet("--concurrency", "10", "--queue", "t", "--keep-completed")
    fleet("--concurrency", "10", "--queue", "t", "--keep-completed")
    await listening(conn, 2)
    await eventually(lambda: conn.fetchval("SELECT count(*) >= 10 FROM aioq.archive"))
    victim.send_signal(signal.SIGKILL)
    worst = 0
    with anyio.fail_after(HANG_GUARD):
        while await conn.fetchval("SELECT count(*) FROM aioq.jobs"):
            counts = await running_per_key(conn, "t")
            worst = max([worst, *counts.values()])
            await anyio.sleep(0.01)
    assert worst <= 2
    assert await conn.fetchval("SELECT count(DISTINCT id) FROM aioq.archive") == 100


def test_cli_sets_and_shows_max_running_per_key(dsn: str) -> None:
    result = aioq_cli(dsn, "queues", "set", "tenants", "--max-running-per-key", "4", "--json")
    assert result.returncode == 0, result.stderr
    assert '"max_running_per_key": 4' in result.stdout
    listed = aioq_cli(dsn, "queues", "list")
    assert listed.stdout.splitlines()[0].split()[-1] == "PER_KEY"
    row = listed.stdout.splitlines()[1].split()
    assert (row[0], row[-1]) == ("tenants", "4")
    bad = aioq_cli(dsn, "queues", "set", "tenants", "--max-running-per-key", "0")
    assert bad.returncode == 2
    assert "max_running_per_key" in bad.stderr
