"""Claim-ahead: jobs claimed beyond the free consumers wait under the heartbeat, released on a
stop; by default ("auto") only as many as the consumers start within one claim round trip, and
given back when they would wait behind long jobs."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Sequence

import anyio
import asyncpg
import pytest
from waits import until_sql

import aioq
from aioq import hooks
from aioq.cli.worker import add_worker_flags
from aioq.errors import ConfigError
from aioq.job import Claim
from aioq.worker.producer import LINGER_FLOOR, RATE_WINDOW, ClaimAhead

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0


async def test_prefetched_jobs_keep_their_lease_and_run_once(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    runs: list[tuple[int, int]] = []

    # Each run outlasts the lease, so a prefetched job waits longer than its lease: only the
    # heartbeat keeps the reapers of both workers from handing it to the other one.
    @registry.task(lease=1.0)
    async def slow() -> None:
        job = aioq.current_job()
        runs.append((job.id, job.attempt))
        await anyio.sleep(1.6)

    ids = [await slow.defer(conn) for _ in range(4)]
    options = {
        "concurrency": 1,
        "prefetch": 1,
        "heartbeat_interval": 0.2,
        "reaper_interval": 0.2,
    }
    async with make_worker(**options), make_worker(**options):
        with anyio.fail_after(HANG_GUARD):
            await until_sql(conn, "SELECT NOT EXISTS (SELECT FROM aioq.jobs)")
    assert sorted(runs) == [(job_id, 1) for job_id in ids]


@pytest.mark.parametrize("how", ["stop", "hard cancel"])
async def test_a_stopping_worker_releases_its_prefetched_jobs(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    how: str,
) -> None:
    started = anyio.Event()

    @registry.task
    async def hold() -> None:
        started.set()
        await anyio.sleep_forever()

    worker = make_worker(concurrency=1, prefetch=2, shutdown_grace=0.2)
    ids = [await hold.defer(conn) for _ in range(3)]
    mine = "SELECT count(*) FROM aioq.jobs WHERE status = 'running' AND locked_by = $1"
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            await started.wait()
            await until_sql(conn, f"SELECT ({mine}) >= 3", worker.id)  # one running, two ahead
            if how == "stop":
                worker.stop()
            else:
                tg.cancel_scope.cancel()
    rows = await conn.fetch("SELECT id, status, locked_by, attempts FROM aioq.jobs ORDER BY id")
    assert [tuple(r) for r in rows] == [(job_id, "pending", None, 0) for job_id in ids]


def test_prefetch_is_validated() -> None:
    for bad in (-1, "fast", True, 1.5):
        with pytest.raises(ConfigError, match="prefetch"):
            aioq.WorkerConfig(prefetch=bad)  # type: ignore[arg-type]
    assert aioq.WorkerConfig(prefetch=0).prefetch == 0
    assert aioq.WorkerConfig().prefetch == "auto"


def paced(ahead: ClaimAhead, *, jobs_per_second: float, round_trip: float) -> int:
    """The claim-ahead after a window in which the consumers finished jobs at this pace."""
    ahead.observe(round_trip)
    window = 0.0625  # longer than RATE_WINDOW, and exact in binary
    assert window > RATE_WINDOW
    ahead.size(0, 1.0)  # opens a window
    return ahead.size(round(jobs_per_second * window), 1.0 + window)


def test_auto_claims_ahead_what_the_consumers_start_within_one_round_trip() -> None:
    # No pace measured yet (a worker that starts, or wakes up idle): nothing ahead.
    assert ClaimAhead(fixed=None, limit=10).size(0, 100.0) == 0
    # No-op jobs: 10 000/s with a 1.46 ms claim: 14 start within one claim, at most the 10
    # consumers of a c10 worker, all 14 at c50.
    assert paced(ClaimAhead(fixed=None, limit=10), jobs_per_second=10_000, round_trip=0.00146) == 10
    assert paced(ClaimAhead(fixed=None, limit=50), jobs_per_second=10_000, round_trip=0.00146) == 14
    # 50 ms jobs at c10 (200/s) with a 1 ms claim: a job claimed ahead would wait 5 ms for a
    # consumer, longer than the 1 ms it saves.
    assert paced(ClaimAhead(fixed=None, limit=10), jobs_per_second=200, round_trip=0.001) == 0
    # A fixed prefetch is what it says, and keeps its jobs however long they wait.
    fixed = ClaimAhead(fixed=3, limit=10)
    assert paced(fixed, jobs_per_second=0, round_trip=0.001) == 3
    assert fixed.linger() is None
    auto = ClaimAhead(fixed=None, limit=10)
    assert paced(auto, jobs_per_second=10_000, round_trip=0.00146) == 10
    assert auto.linger() == LINGER_FLOOR
    auto.gave_back(700, 2.0)
    assert auto.size(700, 2.0) == 0  # after giving back: nothing ahead until a pace shows


async def test_claimed_ahead_jobs_never_wait_behind_long_ones_while_another_worker_is_idle(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """The prefetch trap: no job waits claimed by a worker whose consumers all run long jobs
    while another worker has a free consumer.

    Worker A (2 consumers, the default claim-ahead) drains short jobs, so it claims ahead, then
    reaches two long jobs with two short ones behind them. Worker B starts once both long jobs
    run in A. The long jobs end only once both short ones after them have run (or after the
    hang guard): those must run on B, while A's consumers are still busy. A worker that keeps
    them claimed ahead (prefetch=2, for one) makes them wait for the long jobs.
    """
    long_running, tail_done = anyio.Event(), anyio.Event()
    longs: list[bool] = []
    tail_workers: list[str] = []

    @registry.task
    async def short(i: int) -> None:
        pass

    @registry.task
    async def long() -> None:
        longs.append(False)
        if len(longs) == 2:
            long_running.set()
        with anyio.move_on_after(HANG_GUARD / 3):
            await tail_done.wait()
        longs.append(tail_done.is_set())

    @registry.task
    async def tail() -> None:
        tail_workers.append(aioq.current_job().worker_id)
        if len(tail_workers) == 2:
            tail_done.set()

    await short.defer_many(conn, [{"i": i} for i in range(300)])
    await long.defer(conn)
    await long.defer(conn)
    await tail.defer(conn)
    await tail.defer(conn)
    a = make_worker(concurrency=2)
    b = make_worker(concurrency=2)
    with anyio.fail_after(HANG_GUARD):
        async with a:
            await long_running.wait()
            async with b:
                await until_sql(conn, "SELECT NOT EXISTS (SELECT FROM aioq.jobs)")
    assert sorted(longs) == [False, False, True, True]  # both long jobs saw the tail done
    assert tail_workers == [b.id, b.id]


@pytest.mark.parametrize(("given", "prefetch"), [([], "auto"), (["auto"], "auto"), (["3"], 3)])
def test_the_cli_takes_auto_or_a_count(given: list[str], prefetch: object) -> None:
    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    args = parser.parse_args(["--prefetch", *given] if given else [])
    assert args.prefetch == prefetch
    assert aioq.WorkerConfig(prefetch=args.prefetch).prefetch == prefetch
    for bad in ("-1", "fast"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--prefetch", bad])


class Counted(hooks.Observer):
    """Counts the claim statements and the jobs each kind of outcome settled."""

    def __init__(self) -> None:
        self.claims = 0
        self.outcomes: Counter[str] = Counter()

    def claimed(self, worker_id: str, claims: Sequence[Claim], start_ns: int, end_ns: int) -> None:
        self.claims += 1

    def settled(
        self,
        worker_id: str,
        outcome: str,
        settled: Sequence[tuple[Claim, str | None]],
        start_ns: int,
        end_ns: int,
    ) -> None:
        self.outcomes[outcome] += len(settled)


async def test_a_steady_drain_at_high_concurrency_gives_nothing_back(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """Tasks that wait on I/O at concurrency 1 000, the table analysed while nothing ran: every
    job is claimed once, none is given back.

    With statistics that saw no running row, the fenced writes once took a second per batch;
    the consumers waited for the completer's room, no slot freed within the linger, and the
    claims ahead went back 1 000 at a time, to be claimed again.
    """

    @registry.task
    async def io(i: int) -> None:
        await anyio.sleep(0.05)

    jobs = 20_000
    await io.defer_many(conn, [{"i": i} for i in range(jobs)])
    await conn.execute("VACUUM ANALYZE aioq.jobs")
    counted = Counted()
    hooks.install(counted)
    try:
        with anyio.fail_after(HANG_GUARD * 4):
            await make_worker(concurrency=1000).run_until_idle()
    finally:
        hooks.uninstall(counted)
    assert counted.outcomes == {"succeeded": jobs}
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
