"""Fleet-wide queue limits: max_running, rate, pause and resume, enforced by PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from procs import aioq_cli, assert_one_line_error, fleet_of, listening
from waits import eventually

import aioq
from aioq.db import Executor
from aioq.limits import MAX_INT, MAX_RATE_PERIOD, MIN_RATE_PERIOD
from aioq.worker.claimer import Claimer

HANG_GUARD = 60.0
MakeWorker = Callable[..., aioq.Worker]


async def settings(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    return [dict(r) for r in await conn.fetch("SELECT * FROM aioq.queues ORDER BY name")]


async def defer_noops(conn: asyncpg.Connection, queue: str, n: int, sleep: float = 0.0) -> None:
    await conn.execute(
        "INSERT INTO aioq.jobs (queue, task, args)"
        " SELECT $1, 'nap', jsonb_build_object('sleep', $3::float8) FROM generate_series(1, $2)",
        queue,
        n,
        sleep,
    )


# --- the API ---


@pytest.mark.anyio
async def test_set_queue_and_queues(conn: asyncpg.Connection) -> None:
    await defer_noops(conn, "emails", 3)
    info = await aioq.admin.set_queue(conn, "billing", max_running=5, rate=(100, 60.0))
    assert (info.name, info.max_running, info.rate, info.paused) == (
        "billing",
        5,
        (100, 60.0),
        False,
    )
    assert info.window_claims == 0
    # What is not given stays; None removes a limit; a timedelta is a period.
    info = await aioq.admin.set_queue(conn, "billing", paused=True)
    assert (info.max_running, info.rate, info.paused) == (5, (100, 60.0), True)
    info = await aioq.admin.set_queue(conn, "billing", rate=None, max_running=2)
    assert (info.max_running, info.rate, info.paused) == (2, None, True)
    info = await aioq.admin.set_queue(conn, "billing", rate=(3, timedelta(minutes=1)), paused=False)
    assert (info.rate, info.paused) == ((3, 60.0), False)
    # A queue that only has jobs may be paused; it then has settings.
    info = await aioq.admin.set_queue(conn, "emails", paused=True)
    assert (info.paused, info.ready, info.max_running) == (True, 3, None)
    listed = await aioq.admin.queues(conn)
    assert [(q.name, q.paused, q.ready) for q in listed] == [
        ("billing", False, 0),
        ("emails", True, 3),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("options", "field", "fragment"),
    [
        ({"max_running": 0}, "max_running", "must be an integer >= 1 or None, got 0"),
        ({"max_running": -3}, "max_running", "got -3"),
        ({"max_running": True}, "max_running", "got True"),
        ({"max_running": 2.5}, "max_running", "got 2.5"),
        (
            {"rate": (-1, 1.0)},
            "rate",
            "claims from 1 to 2147483647 and seconds from 0.001 to 31622400 (a year),"
            " got (-1, 1.0)",
        ),
        # Under a millisecond the interval rounds to nothing (its CHECK) or slots to nothing.
        ({"rate": (1, 4e-7)}, "rate", "got (1, 4e-07)"),
        ({"rate": (1, 0.0009)}, "rate", "got (1, 0.0009)"),
        ({"rate": (1, timedelta(microseconds=1))}, "rate", "seconds from 0.001"),
        ({"rate": (1, float("nan"))}, "rate", "got (1, nan)"),
        ({"rate": (1, 366 * 86400 + 1)}, "rate", "got (1, 31622401)"),
        ({"rate": (2**31, 1.0)}, "rate", "got (2147483648, 1.0)"),
        ({"rate": (10, -1.0)}, "rate", "got (10, -1.0)"),
        ({"rate": (10, 0)}, "rate", "got (10, 0)"),
        ({"rate": (10, float("inf"))}, "rate", "got (10, inf)"),
        ({"rate": 10}, "rate", "got 10"),
        ({"paused": "yes"}, "paused", "must be True or False"),
        ({}, "set_queue", "give max_running, rate or paused"),
    ],
)
async def test_bad_values_change_nothing(
    conn: asyncpg.Connection, options: dict[str, Any], field: str, fragment: str
) -> None:
    await aioq.admin.set_queue(conn, "billing", max_running=5)
    before = await settings(conn)
    with pytest.raises(aioq.errors.ConfigError) as caught:
        await aioq.admin.set_queue(conn, "billing", **options)
    assert caught.value.field == field
    assert "'billing'" in str(caught.value) or field == "queue"
    assert fragment in str(caught.value)
    assert await settings(conn) == before


@pytest.mark.anyio
async def test_a_queue_with_nothing_yet_can_be_paused_not_resumed(
    conn: asyncpg.Connection, make_worker: MakeWorker, registry: aioq.Registry
) -> None:
    @registry.task(name="charge", queue="billing")
    async def charge() -> None: ...

    # Pausing ahead of a deploy: the queue has no limit and no jobs yet.
    info = await aioq.admin.set_queue(conn, "billing", paused=True)
    assert (info.name, info.paused, info.max_running, info.ready) == ("billing", True, None, 0)
    # The deploy defers; two workers leave the job alone until the resume.
    job_id = await charge.defer(conn)
    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(make_worker(queues=["billing"]).run_until_idle)
    assert await conn.fetchval("SELECT status FROM aioq.jobs WHERE id = $1", job_id) == "pending"
    await aioq.admin.set_queue(conn, "billing", paused=False)
    await make_worker(queues=["billing"]).run_until_idle()
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
    # A resume of a queue that was never paused is a typo.
    with pytest.raises(aioq.errors.ConfigError, match=r"unknown queue 'bilint'.*a typo") as caught:
        await aioq.admin.set_queue(conn, "bilint", paused=False)
    assert caught.value.field == "queue"
    with pytest.raises(aioq.errors.ConfigError, match="non-empty name"):
        await aioq.admin.set_queue(conn, "", max_running=1)
    assert [row["name"] for row in await settings(conn)] == ["billing"]


@pytest.mark.anyio
async def test_the_rate_bounds_are_what_the_database_stores(conn: asyncpg.Connection) -> None:
    shortest = await aioq.admin.set_queue(conn, "fast", rate=(1, MIN_RATE_PERIOD))
    assert shortest.rate == (1, MIN_RATE_PERIOD)
    longest = await aioq.admin.set_queue(conn, "slow", rate=(MAX_INT, MAX_RATE_PERIOD))
    assert longest.rate == (MAX_INT, MAX_RATE_PERIOD)


# --- the claim ---


def claimer(db: Executor, queues: list[str], worker_id: str = "w") -> Claimer:
    """A worker's claims on these queues (what its producer calls)."""
    return Claimer(schema="aioq", db=db, queues=queues, worker_id=worker_id, ring=lambda: None)


@pytest.mark.anyio
async def test_claims_of_a_limited_queue_take_no_more_than_its_room(
    dsn: str, conn: asyncpg.Connection
) -> None:
    """32 claimers at once, each asking for 50, on a queue with max_running=5: 5 in all."""
    await defer_noops(conn, "billing", 500)
    await aioq.admin.set_queue(conn, "billing", max_running=5)
    claimed: list[int] = []
    async with asyncpg.create_pool(dsn, min_size=32, max_size=32) as pool:

        async def claim(i: int) -> None:
            gate = claimer(pool, ["billing", "default"], f"w{i}")
            claimed.extend(c.id for c in await gate.claim(50))

        async with anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(claim, i)
    assert len(claimed) == 5
    running = "SELECT count(*) FROM aioq.jobs WHERE status = 'running'"
    assert await conn.fetchval(running) == 5
    # A limit raised takes effect at the next claim; a lowered one lets none in until below it.
    gate = claimer(conn, ["billing"])
    await aioq.admin.set_queue(conn, "billing", max_running=7)
    assert len(await gate.claim(50)) == 2
    await aioq.admin.set_queue(conn, "billing", max_running=3)
    assert await gate.claim(50) == []
    # Removing the limit: the plain claim again (after the view is read anew).
    await aioq.admin.set_queue(conn, "billing", max_running=None)
    gate.changed()
    assert len(await gate.claim(50)) == 50
    assert gate.limited == frozenset()


@pytest.mark.anyio
async def test_a_rate_window_counts_claims(conn: asyncpg.Connection) -> None:
    await defer_noops(conn, "api", 100)
    await aioq.admin.set_queue(conn, "api", rate=(7, 3600.0))
    gate = claimer(conn, ["api"])
    assert len(await gate.claim(5)) == 5
    assert len(await gate.claim(5)) == 2
    assert await gate.claim(5) == []
    assert gate.wake_after == pytest.approx(360.0)  # a tenth of the period
    # Once the rate is gone, so is the early wake-up.
    await aioq.admin.set_queue(conn, "api", rate=None)
    gate.changed()
    assert len(await gate.claim(1)) == 1
    assert gate.wake_after == float("inf")
    await aioq.admin.set_queue(conn, "api", rate=(7, 3600.0))
    gate.changed()
    # An idle rate-limited queue is not polled faster: no jobs held back, nothing to wake for.
    idle = claimer(conn, ["quiet"])
    await aioq.admin.set_queue(conn, "quiet", rate=(7, 1.0))
    assert await idle.claim(5) == []
    assert idle.wake_after == float("inf")
    [info, _] = await aioq.admin.queues(conn)
    assert info.window_claims == 7
    # Completing the jobs does not give the window back: it counts claims, not running jobs.
    await conn.execute("DELETE FROM aioq.jobs WHERE status = 'running'")
    assert await gate.claim(5) == []
    # A window that has passed no longer counts (its slots are pruned by the next claim).
    await conn.execute("UPDATE aioq.queue_claims SET slot_end = slot_end - interval '2 hours'")
    assert len(await gate.claim(10)) == 7
    assert await conn.fetchval("SELECT count(*) FROM aioq.queue_claims") == 1


# --- real workers ---

NAPPER = textwrap.dedent(
    """
    import asyncio

    import aioq

    registry = aioq.Registry()


    @registry.task(name="nap")
    async def nap(sleep: float = 0.0) -> None:
        await asyncio.sleep(sleep)
    """
)


@pytest.fixture
def fleet(dsn: str, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``aioq worker napper:registry`` processes; stopped (or killed) at teardown."""
    (tmp_path / "napper.py").write_text(NAPPER)
    yield from fleet_of(dsn, tmp_path, "napper:registry")


@pytest.mark.anyio
async def test_max_running_holds_across_worker_processes(
    conn: asyncpg.Connection, fleet: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """3 processes x concurrency 20 on a queue with max_running=3, jobs of 0.2 s: never more
    than 3 running (sampled every 20 ms in the database), and 3 at once is reached."""
    jobs = 60
    await aioq.admin.set_queue(conn, "limited", max_running=3)
    fleet("--processes", "3", "--concurrency", "20", "--queue", "limited", "--keep-completed")
    await listening(conn, 3)
    await defer_noops(conn, "limited", jobs, sleep=0.2)
    samples: list[int] = []
    with anyio.fail_after(HANG_GUARD):
        while (
            len(samples) < 5 or samples[-1] or await conn.fetchval("SELECT count(*) FROM aioq.jobs")
        ):
            samples.append(
                await conn.fetchval(
                    "SELECT count(*) FROM aioq.jobs WHERE queue = 'limited' AND status = 'running'"
                )
            )
            await anyio.sleep(0.02)
    assert max(samples) == 3, samples
    first, last = await conn.fetchrow("SELECT min(started_at), max(finished_at) FROM aioq.archive")
    assert await conn.fetchval("SELECT count(*) FROM aioq.archive") == jobs
    # Reported, not asserted: a rate is the benchmarks' business (on a loaded machine it varies).
    rate = jobs / (last - first).total_seconds()
    print(f"\nmax_running=3, 0.2 s jobs: {rate:.1f} jobs/s (ideal 15), max running {max(samples)}")


@pytest.mark.anyio
async def test_rate_limit_holds_in_every_window(
    conn: asyncpg.Connection, fleet: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """rate (20, 1.0) for 4+ s: at most 20 claims in any 1 s window, and claims go on past the
    first window's 20."""
    await aioq.admin.set_queue(conn, "api", rate=(20, 1.0))
    await defer_noops(conn, "api", 400)
    fleet("--processes", "2", "--concurrency", "10", "--queue", "api", "--keep-completed")
    await eventually(
        lambda: conn.fetchval(
            "SELECT max(started_at) - min(started_at) >= interval '4 seconds' FROM aioq.archive"
        )
    )
    rows = await conn.fetch("SELECT started_at FROM aioq.archive ORDER BY started_at")
    times = [r[0] for r in rows]
    start = times[0]
    in_4s = [t for t in times if t < start + timedelta(seconds=4)]
    busiest = max(sum(1 for u in times if t <= u < t + timedelta(seconds=1)) for t in times)
    print(f"\nrate 20/1s: {len(in_4s)} claims in the first 4 s, busiest 1 s window {busiest}")
    assert busiest <= 20
    assert len(in_4s) > 20  # the window moves on: not stuck after its first 20


@pytest.mark.anyio
async def test_pause_keeps_jobs_pending_and_resume_wakes_workers_at_once(
    conn: asyncpg.Connection, make_worker: MakeWorker, registry: aioq.Registry
) -> None:
    gate_open = anyio.Event()
    finished: list[int] = []

    @registry.task(name="hold")
    async def hold() -> None:
        await gate_open.wait()
        finished.append(aioq.current_job().id)

    @registry.task(name="nap")
    async def nap(sleep: float = 0.0) -> None:
        finished.append(aioq.current_job().id)

    # A poll interval far longer than the test: only a NOTIFY can wake the workers in time.
    async with make_worker(concurrency=5, queues=["work"], poll_interval=300) as worker:
        async with conn.transaction():
            held = [await hold.options(queue="work").defer(conn) for _ in range(3)]
        running = "SELECT count(*) FROM aioq.jobs WHERE status = 'running'"
        await eventually(lambda: _is(conn, running, 3))
        await aioq.admin.set_queue(conn, "work", paused=True)
        assert worker.current.claimer is not None
        await eventually(
            lambda: "work" in worker.current.claimer.limited, "the gate to see the pause"
        )  # type: ignore[union-attr]
        await defer_noops(conn, "work", 200)
        gate_open.set()  # the running jobs finish normally: a pause aborts nothing
        await eventually(lambda: sorted(finished) == sorted(held), "the held jobs to finish")
        await anyio.sleep(0.5)  # give a wrongful claim the time to show
        assert await conn.fetchval(running) == 0
        pending = "SELECT count(*) FROM aioq.jobs WHERE status = 'pending'"
        assert await conn.fetchval(pending) == 200
        [info] = await aioq.admin.queues(conn)
        assert (info.paused, info.ready, info.running) == (True, 200, 0)
        await aioq.admin.set_queue(conn, "work", paused=False)
        await eventually(lambda: _is(conn, "SELECT count(*) FROM aioq.jobs", 0))
    assert len(finished) == 203


@pytest.mark.anyio
async def test_a_limit_set_on_a_running_worker_holds(
    conn: asyncpg.Connection, make_worker: MakeWorker, registry: aioq.Registry
) -> None:
    """Workers started with no limits obey a max_running set while they run, then its removal."""
    stop = anyio.Event()

    @registry.task(name="nap")
    async def nap(sleep: float = 0.0) -> None:
        await stop.wait()

    running = "SELECT count(*) FROM aioq.jobs WHERE status = 'running'"
    # prefetch=0: 20 running rows are then 20 running jobs (a job claimed ahead is running too).
    async with (
        make_worker(concurrency=10, queues=["work"], prefetch=0),
        make_worker(concurrency=10, queues=["work"], prefetch=0),
    ):
        await defer_noops(conn, "work", 4)
        await eventually(lambda: _is(conn, running, 4))
        await aioq.admin.set_queue(conn, "work", max_running=6)
        await defer_noops(conn, "work", 30)
        await eventually(lambda: _is(conn, running, 6))
        await anyio.sleep(1.5)  # past the workers' refresh: nothing more may start
        assert await conn.fetchval(running) == 6
        await aioq.admin.set_queue(conn, "work", max_running=None)
        await eventually(lambda: _is(conn, running, 20))
        stop.set()


async def _is(conn: asyncpg.Connection, query: str, value: int) -> bool:
    return await conn.fetchval(query) == value  # type: ignore[no-any-return]


# --- the CLI ---


def test_queues_cli(dsn: str) -> None:
    made = aioq_cli(dsn, "queues", "set", "billing", "--max-running", "5", "--rate", "100/60s")
    assert made.returncode == 0, made
    assert made.stdout.splitlines()[0].split()[:4] == ["QUEUE", "STATE", "MAX_RUNNING", "RATE"]
    assert made.stdout.splitlines()[1].split()[:4] == ["billing", "active", "5", "100/60s"]
    paused = aioq_cli(dsn, "queues", "pause", "billing", "--json")
    assert paused.returncode == 0, paused
    [info] = json.loads(paused.stdout)
    assert (info["name"], info["paused"], info["max_running"], info["rate"]) == (
        "billing",
        True,
        5,
        [100, 60.0],
    )
    listed = aioq_cli(dsn, "queues", "list")
    assert listed.returncode == 0, listed
    assert "billing  paused" in listed.stdout
    resumed = aioq_cli(dsn, "queues", "resume", "billing")
    assert "billing  active" in resumed.stdout
    cleared = aioq_cli(dsn, "queues", "set", "billing", "--rate", "none", "--json")
    assert json.loads(cleared.stdout)[0]["rate"] is None
    assert json.loads(cleared.stdout)[0]["max_running"] == 5

    assert_one_line_error(
        aioq_cli(dsn, "queues", "set", "billing", "--max-running", "0"),
        "max_running",
        "queue 'billing'",
        "got 0",
    )
    assert_one_line_error(aioq_cli(dsn, "queues", "set", "billing", "--rate", "-5/1s"), "rate")
    assert_one_line_error(aioq_cli(dsn, "queues", "set", "billing", "--rate", "5/0s"), "rate")
    # Parsed, then refused before the database's CHECK could be (no driver error).
    tiny = aioq_cli(dsn, "queues", "set", "billing", "--rate", "1/0.0000001s")
    message = assert_one_line_error(tiny, "rate", "queue 'billing'", "seconds from 0.001")
    assert "database error" not in message
    assert_one_line_error(aioq_cli(dsn, "queues", "set", "billing"), "give max_running")
    assert_one_line_error(aioq_cli(dsn, "queues", "resume", "bilint"), "unknown queue 'bilint'")
    # Any valid name can be paused, before it has a limit or a job (ahead of a deploy).
    fresh = aioq_cli(dsn, "queues", "pause", "reports", "--json")
    assert fresh.returncode == 0, fresh
    assert json.loads(fresh.stdout)[0]["paused"] is True
    after = json.loads(aioq_cli(dsn, "queues", "list", "--json").stdout)
    assert [(q["name"], q["max_running"], q["rate"], q["paused"]) for q in after] == [
        ("billing", 5, None, False),
        ("reports", None, None, True),
    ]


@pytest.mark.anyio
async def test_ten_workers_of_fifty_never_run_more_than_max_running(
    conn: asyncpg.Connection, make_worker: MakeWorker, registry: aioq.Registry
) -> None:
    """10 workers x concurrency 50 on a queue with max_running=5, sampled in the database."""

    @registry.task(name="nap")
    async def nap(sleep: float = 0.0) -> None:
        await anyio.sleep(sleep)

    await aioq.admin.set_queue(conn, "billing", max_running=5)
    await defer_noops(conn, "billing", 150, sleep=0.03)
    samples: list[int] = []
    running = "SELECT count(*) FROM aioq.jobs WHERE status = 'running'"
    async with anyio.create_task_group() as tg:
        workers = [make_worker(concurrency=50, queues=["billing"]) for _ in range(10)]
        for worker in workers:
            tg.start_soon(worker.run)
        with anyio.fail_after(HANG_GUARD):
            while await conn.fetchval("SELECT count(*) FROM aioq.jobs"):
                samples.append(await conn.fetchval(running))
                await anyio.sleep(0.01)
        for worker in workers:
            worker.stop()
    assert max(samples) <= 5, max(samples)
    assert 5 in samples  # the limit was reached, not just respected


@pytest.mark.anyio
async def test_a_schema_without_limits_tables_claims_as_before(
    conn: asyncpg.Connection,
    make_worker: MakeWorker,
    registry: aioq.Registry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Workers of this version on a schema not yet upgraded: no queue can be limited."""

    @registry.task(name="nap")
    async def nap(sleep: float = 0.0) -> None: ...

    await conn.execute("DROP TABLE aioq.queues, aioq.queue_claims")
    await defer_noops(conn, "default", 20)
    with anyio.fail_after(HANG_GUARD):
        await make_worker(limits_refresh=0.01).run_until_idle()
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
    assert caplog.text.count("queue limits are off until `aioq schema apply`") == 1
