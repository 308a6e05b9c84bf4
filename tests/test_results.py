"""Results you can await and job progress, against a real PostgreSQL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import asyncpg
import pytest
from procs import aioq_cli
from waits import eventually, until_sql

import aioq
from aioq import results
from aioq.worker.maintenance import Pruner

pytestmark = pytest.mark.anyio

TYPING = Path(__file__).parent / "typing"

# Backends whose last statement was a LISTEN on the results channel: the waiters' connections.
RESULT_LISTENERS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND query LIKE 'LISTEN %aioq=aioq%'"
)


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=5) as p:
        yield p


async def test_results_round_trip(
    conn: asyncpg.Connection,
    dsn: str,
    pool: asyncpg.Pool,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    @registry.task(result_ttl=3600)
    async def echo(value: object) -> object:
        return value

    @registry.task(result_ttl=3600)
    def total(a: int, b: int) -> int:  # a sync task's value is kept too
        return a + b

    values = [7, "text", {"a": [1, 2.5, None, True]}, None, [], 2**63 - 1]
    ids = [await echo.defer(conn, value=v) for v in values]
    summed = await total.defer(conn, a=2, b=3)
    async with make_worker():
        with anyio.fail_after(20):
            got = [await aioq.result(pool, job_id) for job_id in ids]
            assert await total.result(conn, summed, timeout=10) == 5
    assert got == values
    assert await echo.result(pool, ids[0]) == 7  # kept: asked again, same answer
    job = await aioq.admin.get_job(conn, ids[2])
    assert job is not None
    assert job.status is aioq.admin.JobStatus.SUCCEEDED
    assert job.result is not None
    assert json.loads(job.result) == {"a": [1, 2.5, None, True]}
    listed = await aioq.admin.list_jobs(conn, status="succeeded", limit=3)
    assert [j.id for j in listed] == ids[:3]
    assert [j.result for j in listed] == ["7", '"text"', '{"a": [1, 2.5, null, true]}']
    none = await aioq.admin.get_job(conn, ids[3])
    assert none is not None
    assert none.result == "null"  # None is stored, as null
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0  # the hot table is empty

    shown = aioq_cli(dsn, "jobs", "show", str(ids[2]), "--json")
    assert shown.returncode == 0, shown
    data = json.loads(shown.stdout)
    assert (data["status"], data["result"]) == ("succeeded", {"a": [1, 2.5, None, True]})
    text = aioq_cli(dsn, "jobs", "show", str(ids[0])).stdout
    assert "\nresult:" + " " * (len("cancel_requested_at:") - len("result:") + 1) + "7\n" in text


async def test_without_result_ttl_nothing_is_kept_and_nobody_is_rung(
    conn: asyncpg.Connection,
    dsn: str,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    @registry.task
    async def plain() -> int:
        return 1

    listener = await asyncpg.connect(dsn)
    heard: list[str] = []
    await listener.add_listener("aioq=aioq", lambda *args: heard.append(args[3]))
    job_id = await plain.defer(conn)
    await make_worker().run_until_idle()
    with pytest.raises(aioq.ResultMissing, match=f"job {job_id}: no result is stored"):
        await aioq.result(conn, job_id, timeout=1)
    with pytest.raises(aioq.errors.ConfigError, match="keeps no results"):
        await plain.result(conn, job_id)
    assert await conn.fetchval("SELECT count(*) FROM aioq.results") == 0
    await listener.execute("SELECT 1")  # a round trip: any notification has arrived by now
    assert heard == []
    await listener.close()


async def test_dead_job_raises_job_failed_and_bad_return_values_fail_the_attempt(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task(result_ttl=60, max_attempts=1)
    async def broken() -> int:
        raise ValueError("no stock for order 7")

    @registry.task(
        name="weird", result_ttl=60, max_attempts=2, retry=aioq.Backoff(base=0, jitter=0)
    )
    async def weird() -> object:
        return {1, 2}

    failed = await broken.defer(conn)
    odd = await weird.defer(conn)
    async with make_worker():
        with anyio.fail_after(20):
            with pytest.raises(aioq.JobFailed) as raised:
                await broken.result(conn, failed)
            with pytest.raises(aioq.JobFailed) as odd_raised:
                await aioq.result(conn, odd)
    assert raised.value.job_id == failed
    assert raised.value.last_error is not None
    assert raised.value.last_error.startswith("ValueError: no stock for order 7")
    assert "no stock for order 7" in str(raised.value)
    # Not JSON: the attempt failed with a clear error and followed the retry policy.
    job = await aioq.admin.get_job(conn, odd)
    assert job is not None
    assert (job.status, job.attempts) == (aioq.admin.JobStatus.DEAD, 2)
    assert job.last_error == (
        "ResultError: task 'weird': return value has type set, which is not JSON (use None,"
        " bool, int, float, str, list or dict with str keys)"
    )
    assert odd_raised.value.last_error == job.last_error


async def test_timeout_raises_and_leaves_the_job_alone(
    conn: asyncpg.Connection, pool: asyncpg.Pool, registry: aioq.Registry
) -> None:
    @registry.task(result_ttl=60)
    async def slow() -> int:
        return 1

    job_id = await slow.defer(conn)
    before = await conn.fetchrow("SELECT * FROM aioq.jobs WHERE id = $1", job_id)
    with anyio.fail_after(10):
        with pytest.raises(TimeoutError) as raised:
            await slow.result(pool, job_id, timeout=0.3)
        with pytest.raises(aioq.ResultTimeout, match="still pending after 0s"):
            await aioq.result(conn, job_id, timeout=0)
    assert isinstance(raised.value, aioq.ResultTimeout)
    assert raised.value.status == "pending"
    assert await conn.fetchrow("SELECT * FROM aioq.jobs WHERE id = $1", job_id) == before
    assert results.listening_connections() == 0  # the last waiter gave its LISTEN back
    with pytest.raises(aioq.errors.ConfigError, match="timeout"):
        await aioq.result(conn, job_id, timeout=-1)


async def test_a_pool_of_one_connection_times_out_and_still_gets_results(
    conn: asyncpg.Connection,
    dsn: str,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    """The LISTEN never takes a pool's only connection: the waiter polls on it instead."""

    @registry.task(result_ttl=60)
    async def echo(value: int) -> int:
        return value

    job_id = await echo.defer(conn, value=7)
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
        with anyio.fail_after(10):  # a hang guard: it used to deadlock on its own LISTEN
            with pytest.raises(aioq.ResultTimeout) as raised:
                await aioq.result(pool, job_id, timeout=0.5)
        assert raised.value.status == "pending"
        assert results.listening_connections() == 0
        async with pool.acquire():  # the application holds the only connection: no read
            with anyio.fail_after(10), pytest.raises(aioq.ResultTimeout) as starved:
                await aioq.result(pool, job_id, timeout=0.3)
        assert starved.value.status == "unknown"
        assert "no connection came free" in str(starved.value)
        async with make_worker():
            with anyio.fail_after(20):
                assert await aioq.result(pool, job_id, timeout=15) == 7


async def test_the_listen_leaves_the_application_its_last_connection(
    conn: asyncpg.Connection,
    dsn: str,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    """max_size=3 and the application holding two: the third stays the application's."""

    @registry.task(result_ttl=60)
    async def echo(value: int) -> int:
        return value

    job_id = await echo.defer(conn, value=3)
    async with (
        asyncpg.create_pool(dsn, min_size=1, max_size=3) as pool,
        pool.acquire() as first,
        pool.acquire() as second,
    ):
        with anyio.fail_after(10):
            with pytest.raises(aioq.ResultTimeout, match="still pending"):
                await aioq.result(pool, job_id, timeout=0.5)
            async with anyio.create_task_group() as tg:
                got: list[int] = []

                async def wait() -> None:
                    got.append(await aioq.result(pool, job_id, timeout=8))

                tg.start_soon(wait)
                await eventually(lambda: results._hubs, "the waiter's hub")
                async with pool.acquire() as third:  # free at once: no LISTEN holds it
                    assert await third.fetchval("SELECT 1") == 1
                assert results.listening_connections() == 0
                assert [await c.fetchval("SELECT 1") for c in (first, second)] == [1, 1]
                async with make_worker():
                    await eventually(lambda: got, "the result")
        assert got == [3]


async def test_the_listen_gives_its_connection_back_when_the_application_runs_short(
    conn: asyncpg.Connection,
    dsn: str,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    @registry.task(result_ttl=60)
    async def echo(value: int) -> int:
        return value

    job_id = await echo.defer(conn, value=5)
    async with asyncpg.create_pool(dsn, min_size=3, max_size=3) as pool:
        got: list[int] = []
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:

                async def wait() -> None:
                    got.append(await aioq.result(pool, job_id, timeout=15))

                tg.start_soon(wait)
                await eventually(lambda: results.listening_connections() == 1, "the LISTEN")
                # Two fill the pool beside the LISTEN: the third is the LISTEN's, given back
                # once the waiter sees the application short.
                async with (
                    pool.acquire() as first,
                    pool.acquire() as second,
                    pool.acquire() as third,
                ):
                    assert results.listening_connections() == 0
                    values = [await c.fetchval("SELECT 1") for c in (first, second, third)]
                    assert values == [1, 1, 1]
                async with make_worker():
                    await eventually(lambda: got, "the result")
    assert got == [5]


async def test_cancelled_job_raises_job_cancelled(
    conn: asyncpg.Connection, pool: asyncpg.Pool, registry: aioq.Registry
) -> None:
    @registry.task(result_ttl=60)
    async def never() -> int:
        return 1

    job_id = await never.defer(conn)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            outcome: list[BaseException] = []

            async def wait() -> None:
                try:
                    await never.result(pool, job_id, timeout=None)
                except aioq.errors.NoResult as exc:
                    outcome.append(exc)

            tg.start_soon(wait)
            await until_sql(pool, f"SELECT ({RESULT_LISTENERS}) > 0")
            await aioq.admin.cancel_jobs(conn, [job_id])  # pending: rings the waiter at once
    assert [type(e) for e in outcome] == [aioq.JobCancelled]


async def test_200_concurrent_waiters_share_one_listen_connection(
    conn: asyncpg.Connection,
    pool: asyncpg.Pool,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    @registry.task(result_ttl=600)
    async def square(n: int) -> int:
        return n * n

    ids = await square.defer_many(conn, [{"n": n} for n in range(200)])
    got: dict[int, int] = {}
    listeners_seen: set[int] = set()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:

            async def wait(job_id: int) -> None:
                got[job_id] = await square.result(pool, job_id, timeout=50)

            for job_id in ids:
                tg.start_soon(wait, job_id)

            async def all_in() -> bool:
                # every waiter is in, and the first one's LISTEN is set up
                return (
                    sum(h.count for h in results._hubs.values()) >= 200
                    and results.listening_connections() >= 1
                    and bool(await conn.fetchval(RESULT_LISTENERS))
                )

            await eventually(all_in, "200 waiters and their LISTEN", every=0.01)
            listeners_seen.add(await conn.fetchval(RESULT_LISTENERS))
            listeners_seen.add(results.listening_connections())
            assert pool.get_size() <= 5
            async with make_worker(concurrency=20):
                while len(got) < 200:
                    seen = await conn.fetchval(RESULT_LISTENERS)
                    # The last waiter drops the hub, then UNLISTENs, before its result lands in
                    # `got`: a sample taken once the hub is gone may see that close (0).
                    if results._hubs:
                        listeners_seen.add(seen)
                    await anyio.sleep(0.05)
    assert got == {job_id: n * n for n, job_id in enumerate(ids)}
    assert listeners_seen == {1}
    assert results.listening_connections() == 0
    assert len(results._hubs) == 0


async def test_a_waiter_polls_when_it_cannot_listen(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task(result_ttl=60)
    async def later() -> str:
        return "done"

    job_id = await later.defer(conn)
    # Inside a transaction, LISTEN takes effect only at commit: the waiter hears nothing.
    async with conn.transaction(), make_worker():
        with anyio.fail_after(20):
            assert await later.result(conn, job_id) == "done"


async def test_expired_results_raise_result_missing_and_are_pruned(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task(result_ttl=0.2)
    async def brief() -> int:
        return 1

    @registry.task(result_ttl=3600)
    async def lasting() -> int:
        return 2

    short = [await brief.defer(conn) for _ in range(3)]
    kept = await lasting.defer(conn)
    await make_worker().run_until_idle()
    await conn.execute(
        "UPDATE aioq.results SET expires_at = now() - interval '1 second' WHERE id = ANY($1)",
        short,
    )
    with pytest.raises(aioq.ResultMissing, match="expired"):
        await aioq.result(conn, short[0])
    prune = Pruner(
        schema="aioq",
        db=conn,
        archive_retention=None,
        dead_retention=None,
        workflow_retention=None,
        interval=1,
        batch_size=2,
    )
    assert [await prune.run_once() for _ in range(3)] == [2, 1, 0]  # bounded batches
    with pytest.raises(aioq.ResultMissing, match="no result is stored"):
        await brief.result(conn, short[0])
    assert await aioq.admin.get_job(conn, short[0]) is None
    assert await lasting.result(conn, kept) == 2


async def test_set_progress_is_visible_while_the_job_runs(
    conn: asyncpg.Connection,
    dsn: str,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
) -> None:
    reported, finish = anyio.Event(), anyio.Event()
    refused: list[str] = []

    @registry.task(result_ttl=60)
    async def rows() -> int:
        job = aioq.current_job()
        await job.set_progress(0.4, note="40 of 100 rows")
        for bad in (1.5, -0.1, float("nan"), True):
            try:
                await job.set_progress(bad)
            except aioq.errors.ConfigError as exc:
                refused.append(exc.field)
        reported.set()
        await finish.wait()
        await job.set_progress(1)
        return 100

    @registry.task(result_ttl=60)
    def sync_rows() -> str:
        job = aioq.current_job()
        anyio.from_thread.run(lambda: job.set_progress(0.5, note="half"))
        return "ok"

    job_id = await rows.defer(conn)
    sync_id = await sync_rows.options(max_attempts=1).defer(conn)
    other = await asyncpg.connect(dsn)
    async with make_worker():
        with anyio.fail_after(20):
            await reported.wait()
            job = await aioq.admin.get_job(other, job_id)
            assert job is not None
            assert (job.status, job.progress, job.progress_note) == (
                aioq.admin.JobStatus.RUNNING,
                0.4,
                "40 of 100 rows",
            )
            shown = json.loads(aioq_cli(dsn, "jobs", "show", str(job_id), "--json").stdout)
            assert (shown["progress"], shown["progress_note"]) == (0.4, "40 of 100 rows")
            finish.set()
            assert await rows.result(other, job_id) == 100
    await other.close()
    done = await aioq.admin.get_job(conn, job_id)
    assert done is not None
    assert (done.progress, done.progress_note) == (1.0, None)
    assert refused == ["progress"] * 4
    # A sync task reports through anyio.from_thread; the kept result row keeps it too.
    assert await sync_rows.result(conn, sync_id) == "ok"
    synced = await aioq.admin.get_job(conn, sync_id)
    assert synced is not None
    assert (synced.status, synced.progress, synced.progress_note) == ("succeeded", 0.5, "half")
    with pytest.raises(aioq.AioqError, match="outside a running aioq task"):
        aioq.current_job()


# --- static typing ---------------------------------------------------------------------------

_EXPECTED = re.compile(r"# error: \[([a-z-]+)\]")
_REPORTED = re.compile(r"^[^:]+:(\d+): error: .*\[([a-z-]+)\]$")


def test_mypy_types_results_by_the_task(tmp_path: Path) -> None:
    path = TYPING / "result_types.py"
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
         "--show-error-codes", "--cache-dir", str(tmp_path), str(path)],
        capture_output=True, text=True, cwd=TYPING.parent.parent, timeout=300, check=False,
    )  # fmt: skip
    reported = set()
    for line in done.stdout.splitlines():
        match = _REPORTED.match(line)
        if match:
            reported.add((int(match.group(1)), match.group(2)))
    expected = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        found = _EXPECTED.search(line)
        if found:
            expected.add((number, found.group(1)))
    assert len(expected) == 4
    assert reported == expected, done.stdout + done.stderr


@pytest.mark.timeout(120)
def test_jobcontrol_example_runs(dsn: str) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "jobcontrol.py"
    done = subprocess.run(
        [sys.executable, str(example)],
        env={**os.environ, "AIOQ_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1. total: 700; status succeeded, progress 0.5" in done.stdout
    assert "3. cancel_jobs: {1: 'finished', 2: 'cancelling', 3: 'cancelling'}" in done.stdout
    assert "job 3: was cancelled" in done.stdout
