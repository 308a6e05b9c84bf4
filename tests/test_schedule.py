"""Periodic jobs: tick arithmetic, cron and DST, exactly one job per tick, catch-up, the CLI."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import asyncpg
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from procs import LISTENERS, aioq_cli, assert_one_line_error, children
from waits import eventually, until_sql

import aioq
import aioq.metrics
from aioq.schedule import MAX_CATCH_UP_TICKS, MAX_SKIPPED_COUNT
from aioq.worker.scheduler import Scheduler

HANG_GUARD = 60.0
PARIS = "Europe/Paris"


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def scheduler(registry: aioq.Registry, db: asyncpg.Connection | asyncpg.Pool) -> Scheduler:
    return Scheduler(schema="aioq", db=db, schedules=list(registry.schedules.values()))


async def ticks_of(conn: asyncpg.Connection, task: str) -> list[datetime]:
    rows = await conn.fetch(
        "SELECT scheduled_at FROM aioq.jobs WHERE task = $1 ORDER BY scheduled_at, id", task
    )
    return [r[0] for r in rows]


# --- declaring schedules ---


def test_periodic_registers_a_schedule(registry: aioq.Registry) -> None:
    @aioq.periodic(every=timedelta(minutes=1))
    @registry.task(name="refresh")
    async def refresh() -> None: ...

    @aioq.periodic(cron="*/5 * * * *", tz=PARIS, kwargs={"region": "eu"}, catch_up=3600)
    @registry.task(name="report", queue="reports")
    async def report(region: str) -> None: ...

    assert isinstance(refresh, aioq.Task)
    assert registry.schedules["refresh"].every == 60.0
    assert registry.schedules["refresh"].spec == "every 60s"
    assert registry.schedules["report"].spec == f"cron */5 * * * * {PARIS}"
    assert registry.schedules["report"].args == '{"region":"eu"}'
    assert registry.schedules["report"].catch_up == 3600.0


@pytest.mark.parametrize(
    ("options", "field", "fragment"),
    [
        ({"cron": "61 * * * *"}, "cron", "bad cron expression '61 * * * *'"),
        ({"cron": "0 0 30 2 *"}, "cron", "bad cron expression"),
        ({"cron": "* * *"}, "cron", "bad cron expression"),
        ({}, "periodic", "exactly one of every= or cron="),
        ({"every": 60, "cron": "* * * * *"}, "periodic", "exactly one of"),
        ({"every": 0}, "every", "at least 1 second"),
        ({"every": "60"}, "every", "seconds or a timedelta"),
        ({"every": 60, "catch_up": -1}, "catch_up", ">= 0"),
        # Past a century, tick arithmetic overflows datetime on every pass of the scheduler.
        ({"every": math.inf}, "every", "(a century), got inf"),
        ({"every": 1e12}, "every", "at most 3155760000 (a century)"),
        ({"every": math.nan}, "every", "got nan"),
        ({"every": timedelta.max}, "every", "a century"),
        ({"every": 10**400}, "every", "an integer past float's range"),
        ({"every": 60, "catch_up": 10**400}, "catch_up", "an integer past float's range"),
        ({"every": 60, "catch_up": math.inf}, "catch_up", "(a century), got inf"),
        ({"every": 60, "catch_up": 1e12}, "catch_up", "a century"),
        ({"every": 60, "catch_up": math.nan}, "catch_up", "got nan"),
        ({"every": 60, "catch_up": timedelta.max}, "catch_up", "a century"),
        ({"cron": "* * * * *", "tz": "Mars/Olympus"}, "tz", "unknown time zone 'Mars/Olympus'"),
        ({"every": 60, "tz": PARIS}, "tz", "cron= only"),
        ({"every": 60, "kwargs": {"nope": 1}}, "kwargs", "nope"),
        ({"every": 60, "kwargs": {"n": {1, 2}}}, "kwargs", "'n'"),
    ],
)
def test_bad_schedules_fail_at_import_naming_the_task(
    registry: aioq.Registry, options: dict[str, object], field: str, fragment: str
) -> None:
    with pytest.raises(aioq.errors.ConfigError) as caught:

        @aioq.periodic(**options)  # type: ignore[arg-type]
        @registry.task(name="billing.nightly")
        async def nightly(n: int = 0) -> None: ...

    assert caught.value.field == field
    assert "'billing.nightly'" in str(caught.value)
    assert fragment in str(caught.value)
    assert not registry.schedules


def test_cron_without_the_extra_says_what_to_install(
    registry: aioq.Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    @registry.task(name="nightly")
    async def nightly() -> None: ...

    monkeypatch.setitem(sys.modules, "cronsim", None)  # as if not installed
    with pytest.raises(aioq.errors.ConfigError, match=r"pip install 'aioq-pg\[cron\]'") as caught:
        aioq.periodic(cron="* * * * *")(nightly)
    assert "'nightly'" in str(caught.value)
    assert not registry.schedules
    aioq.periodic(every=60)(nightly)  # every= needs nothing


def test_periodic_needs_a_task_under_it(registry: aioq.Registry) -> None:
    with pytest.raises(aioq.errors.ConfigError, match=r"put @aioq.periodic above @aioq.task"):

        @registry.task
        @aioq.periodic(every=60)  # type: ignore[type-var]
        async def wrong_order() -> None: ...


def test_a_second_schedule_of_a_task_needs_its_own_name(registry: aioq.Registry) -> None:
    @registry.task(name="sync")
    async def sync(full: bool = False) -> None: ...

    aioq.periodic(every=60)(sync)
    aioq.periodic(every=60)(sync)  # the same again (a module imported twice) is fine
    with pytest.raises(aioq.errors.ConfigError, match="give each schedule of a task its own name"):
        aioq.periodic(every=3600, kwargs={"full": True})(sync)
    aioq.periodic(every=3600, kwargs={"full": True}, name="sync.full")(sync)
    assert sorted(registry.schedules) == ["sync", "sync.full"]


# --- tick arithmetic ---


def schedule_of(_: aioq.Registry, **options: object) -> aioq.schedule.Schedule:
    registry = aioq.Registry()

    @aioq.periodic(**options)  # type: ignore[arg-type]
    @registry.task(name="t")
    async def t() -> None: ...

    return registry.schedules["t"]


def test_every_ticks_are_aligned_to_the_epoch(registry: aioq.Registry) -> None:
    s = schedule_of(registry, every=60)
    now = utc(2026, 5, 4, 10, 17, 42)
    assert s.latest(now) == utc(2026, 5, 4, 10, 17)
    assert s.next_after(now) == utc(2026, 5, 4, 10, 18)
    assert s.next_after(utc(2026, 5, 4, 10, 18)) == utc(2026, 5, 4, 10, 19)  # strictly after
    assert s.latest(utc(2026, 5, 4, 10, 18)) == utc(2026, 5, 4, 10, 18)
    assert s.ticks(utc(2026, 5, 4, 10, 0), utc(2026, 5, 4, 10, 3), 100) == [
        utc(2026, 5, 4, 10, 1),
        utc(2026, 5, 4, 10, 2),
        utc(2026, 5, 4, 10, 3),
    ]


def cron_next(registry: aioq.Registry, expr: str, local: datetime, n: int = 1) -> list[str]:
    s = schedule_of(registry, cron=expr, tz=PARIS)
    out, t = [], local.astimezone(UTC)
    for _ in range(n):
        t = s.next_after(t)
        out.append(t.isoformat())
    return out


def paris(*args: int) -> datetime:
    from zoneinfo import ZoneInfo

    return datetime(*args, tzinfo=ZoneInfo(PARIS))  # type: ignore[misc]


def test_cron_spring_forward_in_paris(registry: aioq.Registry) -> None:
    """29 March 2026: 02:00 CET jumps to 03:00 CEST. A 02:30 job runs at 03:00, once."""
    assert cron_next(registry, "30 2 * * *", paris(2026, 3, 29, 1, 0), 2) == [
        "2026-03-29T01:00:00+00:00",  # 03:00 CEST, right after the jump
        "2026-03-30T00:30:00+00:00",  # 02:30 CEST the next day
    ]


def test_cron_spring_forward_half_hourly(registry: aioq.Registry) -> None:
    assert cron_next(registry, "*/30 * * * *", paris(2026, 3, 29, 1, 10), 3) == [
        "2026-03-29T00:30:00+00:00",  # 01:30 CET
        "2026-03-29T01:00:00+00:00",  # 03:00 CEST: 02:00 and 02:30 do not exist
        "2026-03-29T01:30:00+00:00",  # 03:30 CEST
    ]


def test_cron_fall_back_in_paris(registry: aioq.Registry) -> None:
    """25 October 2026: 03:00 CEST falls back to 02:00 CET."""
    # A fixed time in the repeated hour runs once (the first 02:30).
    assert cron_next(registry, "30 2 * * *", paris(2026, 10, 25, 0, 0), 2) == [
        "2026-10-25T00:30:00+00:00",  # 02:30 CEST
        "2026-10-26T01:30:00+00:00",  # 02:30 CET the next day
    ]
    # A wildcard hour runs in both passes of the repeated hour, an hour apart in real time.
    assert cron_next(registry, "*/30 * * * *", paris(2026, 10, 25, 1, 50), 5) == [
        "2026-10-25T00:00:00+00:00",  # 02:00 CEST
        "2026-10-25T00:30:00+00:00",  # 02:30 CEST
        "2026-10-25T01:00:00+00:00",  # 02:00 CET
        "2026-10-25T01:30:00+00:00",  # 02:30 CET
        "2026-10-25T02:00:00+00:00",  # 03:00 CET
    ]


def test_cron_leap_day(registry: aioq.Registry) -> None:
    assert cron_next(registry, "0 0 29 2 *", paris(2026, 3, 1, 0, 0), 2) == [
        "2028-02-28T23:00:00+00:00",  # midnight CET on 29 February 2028
        "2032-02-28T23:00:00+00:00",
    ]
    s = schedule_of(registry, cron="0 0 29 2 *", tz=PARIS)
    assert s.latest(utc(2026, 7, 1)) == utc(2024, 2, 28, 23)


def test_cron_latest_agrees_with_forward_iteration_across_dst(registry: aioq.Registry) -> None:
    s = schedule_of(registry, cron="*/30 * * * *", tz=PARIS)
    t = utc(2026, 10, 24, 22)
    for _ in range(12):  # walk through the fall-back night
        nxt = s.next_after(t)
        assert s.latest(nxt) == nxt
        assert s.latest(nxt - timedelta(seconds=1)) == t
        t = nxt


# --- exactly one job per tick, enforced by the database ---


@pytest.mark.anyio
async def test_first_sight_waits_for_the_next_tick_then_enqueues_once(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @aioq.periodic(every=60, kwargs={"region": "eu"})
    @registry.task(name="rates", queue="q", priority=3, max_attempts=2, lease=7)
    async def rates(region: str) -> None: ...

    sched = scheduler(registry, conn)
    now = utc(2026, 5, 4, 10, 17, 42)
    delay = await sched.run_once(now)
    assert delay == pytest.approx(18.0)
    assert await ticks_of(conn, "rates") == []  # 10:17 had passed when the schedule appeared
    row = await conn.fetchrow("SELECT * FROM aioq.schedules WHERE name = 'rates'")
    assert row["last_tick"] == utc(2026, 5, 4, 10, 17)
    assert row["next_tick"] == utc(2026, 5, 4, 10, 18)

    await sched.run_once(now + timedelta(seconds=17))
    assert await ticks_of(conn, "rates") == []
    await sched.run_once(now + timedelta(seconds=18))
    job = await conn.fetchrow("SELECT * FROM aioq.jobs WHERE task = 'rates'")
    assert job["scheduled_at"] == job["run_at"] == utc(2026, 5, 4, 10, 18)
    assert (job["queue"], job["priority"], job["max_attempts"]) == ("q", 3, 2)
    assert job["lease"] == timedelta(seconds=7)
    assert json.loads(job["args"]) == {"region": "eu"}

    # The job ran and left the table: a late worker does not enqueue that tick again.
    await conn.execute("DELETE FROM aioq.jobs")
    late = scheduler(registry, conn)
    await late.run_once(now + timedelta(seconds=30))
    assert await ticks_of(conn, "rates") == []
    assert late.enqueued == 0
    row = await conn.fetchrow("SELECT * FROM aioq.schedules WHERE name = 'rates'")
    assert row["last_tick"] == utc(2026, 5, 4, 10, 18)
    assert row["next_tick"] == utc(2026, 5, 4, 10, 19)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("catch_up", "expected"),
    [
        (0, ["10:05"]),  # default: the most recent missed tick only
        (150, ["10:03", "10:04", "10:05"]),  # ticks at 10:03:20 - 150 s = 10:00:50 or later
        (3600, ["10:01", "10:02", "10:03", "10:04", "10:05"]),
    ],
)
async def test_catch_up_after_downtime(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    caplog: pytest.LogCaptureFixture,
    catch_up: float,
    expected: list[str],
) -> None:
    @aioq.periodic(every=60, catch_up=catch_up)
    @registry.task(name="minutely")
    async def minutely() -> None: ...

    await scheduler(registry, conn).run_once(utc(2026, 5, 4, 10, 0, 30))  # last tick: 10:00
    # Every worker stops for five ticks (10:01 to 10:05), then one starts at 10:05:20.
    with caplog.at_level(logging.WARNING, logger="aioq.worker.scheduler"):
        await scheduler(registry, conn).run_once(utc(2026, 5, 4, 10, 5, 20))
    # 150 s before 10:05:20 is 10:02:50: 10:03, 10:04 and 10:05 are within catch_up.
    assert [f"{t:%H:%M}" for t in await ticks_of(conn, "minutely")] == expected
    skipped = 5 - len(expected)
    if skipped:
        assert f"schedule minutely: skipped {skipped} missed ticks" in caplog.text
    else:
        assert "skipped" not in caplog.text


@pytest.mark.anyio
async def test_two_registries_racing_the_same_ticks_enqueue_each_once(
    dsn: str, conn: asyncpg.Connection
) -> None:
    """Many schedulers of two registries (two deployments) hit the same ticks at once."""
    registries = [aioq.Registry(), aioq.Registry()]
    for reg in registries:

        @aioq.periodic(every=1, catch_up=5)
        @reg.task(name="beat")
        async def beat() -> None: ...

    start = utc(2026, 5, 4, 10, 0, 0)
    async with asyncpg.create_pool(dsn, min_size=16, max_size=16) as pool:
        schedulers = [scheduler(registries[i % 2], pool) for i in range(16)]
        await schedulers[0].run_once(start)
        for second in range(1, 11):
            now = start + timedelta(seconds=second, milliseconds=300)
            # Each round, half of them see the previous second still (a slow worker): they
            # must neither enqueue it twice nor push the schedule back.
            async with anyio.create_task_group() as tg:
                for i, s in enumerate(schedulers):
                    tg.start_soon(s.run_once, now - timedelta(seconds=i % 2))
    ticks = await ticks_of(conn, "beat")
    assert ticks == [start + timedelta(seconds=k) for k in range(1, 11)]
    assert sum(s.enqueued for s in schedulers) == 10


@pytest.mark.anyio
async def test_a_worker_runs_ticks_with_scheduled_at(
    make_worker: Callable[..., aioq.Worker], registry: aioq.Registry, conn: asyncpg.Connection
) -> None:
    seen: list[datetime | None] = []
    two = anyio.Event()

    @aioq.periodic(every=1)
    @registry.task(name="heartbeat")
    async def heartbeat() -> None:
        seen.append(aioq.current_job().scheduled_at)
        if len(seen) >= 2:
            two.set()

    async with make_worker(concurrency=2):
        with anyio.fail_after(HANG_GUARD):
            await two.wait()
    ticks = sorted(t for t in seen if t is not None)
    assert len(ticks) == len(seen)
    assert all(t.microsecond == 0 for t in ticks)
    assert ticks[1] - ticks[0] == timedelta(seconds=1)
    # A job deferred by hand has no tick.
    plain = await heartbeat.defer(conn)
    assert await conn.fetchval("SELECT scheduled_at FROM aioq.jobs WHERE id = $1", plain) is None


@pytest.mark.anyio
async def test_a_failing_schedule_does_not_stop_the_others(
    make_worker: Callable[..., aioq.Worker],
    registry: aioq.Registry,
    conn: asyncpg.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @aioq.periodic(every=60)
    @registry.task(name="broken")
    async def broken() -> None: ...

    @aioq.periodic(every=1)
    @registry.task(name="valid")
    async def valid() -> None: ...

    # What every=inf did before it was refused at decoration: every pass of this schedule
    # raises OverflowError (first sight and the next tick both compute with it). It comes
    # first, so a pass that stopped at it would never reach the valid one.
    object.__setattr__(registry.schedules["broken"], "every", math.inf)
    metrics = aioq.metrics.Metrics()
    worker = make_worker(queues=["elsewhere"], metrics=metrics)
    with caplog.at_level(logging.DEBUG, logger="aioq.worker.scheduler"):
        async with worker:
            await until_sql(
                conn, "SELECT count(*) >= 2 FROM aioq.jobs WHERE task = 'valid'", guard=20
            )
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE task = 'broken'") == 0
    failed = metrics.registry.get_sample_value(
        "aioq_schedule_failures_total", {"schedule": "broken"}
    )
    assert failed is not None
    assert failed >= 2
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "broken" in r.message]
    assert len(errors) == 1  # loud once, quiet while it repeats itself
    assert "the other schedules go on" in errors[0].message
    assert errors[0].exc_info is not None
    assert errors[0].exc_info[0] is OverflowError


@pytest.mark.anyio
async def test_a_worker_with_periodic_false_enqueues_nothing(
    make_worker: Callable[..., aioq.Worker], registry: aioq.Registry, conn: asyncpg.Connection
) -> None:
    @aioq.periodic(every=1)
    @registry.task(name="quiet")
    async def quiet() -> None: ...

    async with make_worker(periodic=False, queues=["elsewhere"]):
        await anyio.sleep(1.5)  # a tick passes: nothing may appear
    assert await conn.fetchval("SELECT count(*) FROM aioq.schedules") == 0


def test_job_context_carries_a_tick(registry: aioq.Registry) -> None:
    from aioq.testing import job_context

    @registry.task(name="hourly")
    def hourly() -> datetime | None:
        return aioq.current_job().scheduled_at

    with job_context(task=hourly, scheduled_at=utc(2026, 5, 4, 10)):
        assert hourly() == utc(2026, 5, 4, 10)
    with job_context(task=hourly):
        assert hourly() is None


# --- real worker processes ---

TICKER = textwrap.dedent(
    """
    import aioq

    registry = aioq.Registry()


    @aioq.periodic(every=1, catch_up=30)
    @registry.task(name="tick", queue="ticks")
    async def tick() -> None:
        pass


    @aioq.periodic(cron="0 0 29 2 *", tz="Europe/Paris")
    @registry.task(name="leap", queue="ticks")
    async def leap() -> None:
        pass
    """
)


def _spawn(workdir: Path, dsn: str, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "AIOQ_DSN": dsn}
    command = [sys.executable, "-m", "aioq", "worker", "ticker:registry", *args]
    with (workdir / "workers.log").open("ab") as log:  # the child keeps its own copy
        return subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=log)


async def _listening(conn: asyncpg.Connection, n: int) -> bool:
    return len(await conn.fetch(LISTENERS)) == n


@pytest.mark.anyio
async def test_three_worker_processes_enqueue_each_tick_once_through_a_sigkill(
    dsn: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """3 processes on a 1 s schedule for 6+ s; one is SIGKILLed midway: one job per tick, no gap.

    The workers serve another queue, so the tick jobs stay in the table to be counted.
    """
    (tmp_path / "ticker.py").write_text(TICKER)
    fleet = _spawn(tmp_path, dsn, "--processes", "3", "--queue", "other")
    try:
        await eventually(lambda: len(children(fleet.pid)) == 3, "three children")
        first = await eventually(lambda: conn.fetchval("SELECT min(scheduled_at) FROM aioq.jobs"))
        await eventually(
            lambda: conn.fetchval(
                "SELECT max(scheduled_at) >= $1 FROM aioq.jobs", first + timedelta(seconds=3)
            )
        )
        victim = sorted(children(fleet.pid))[0]
        os.kill(victim, signal.SIGKILL)
        killed_at = await conn.fetchval("SELECT now()")
        await eventually(
            lambda: conn.fetchval(
                "SELECT max(scheduled_at) >= $1 FROM aioq.jobs", killed_at + timedelta(seconds=3)
            )
        )
    finally:
        fleet.send_signal(signal.SIGTERM)
        fleet.wait(30)
    rows = await conn.fetch(
        "SELECT scheduled_at, count(*) AS n FROM aioq.jobs WHERE task = 'tick'"
        " GROUP BY scheduled_at ORDER BY scheduled_at"
    )
    ticks = [r["scheduled_at"] for r in rows]
    assert all(r["n"] == 1 for r in rows), [dict(r) for r in rows if r["n"] != 1]
    assert len(ticks) >= 6
    assert ticks == [ticks[0] + timedelta(seconds=k) for k in range(len(ticks))]  # no gap
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE task = 'leap'") == 0

    # The CLI lists both schedules with their last and next ticks.
    listed = aioq_cli(dsn, "schedules", "--json")
    assert listed.returncode == 0, listed
    by_name = {s["name"]: s for s in json.loads(listed.stdout)}
    assert sorted(by_name) == ["leap", "tick"]
    assert by_name["tick"]["spec"] == "every 1s"
    assert by_name["tick"]["queue"] == "ticks"
    assert datetime.fromisoformat(by_name["tick"]["last_tick"]) >= ticks[-1]
    assert by_name["leap"]["spec"] == "cron 0 0 29 2 * Europe/Paris"
    assert datetime.fromisoformat(by_name["leap"]["next_tick"]).month in (2, 3)
    table = aioq_cli(dsn, "schedules")
    assert table.returncode == 0, table
    assert "LAST_TICK" in table.stdout.splitlines()[0]
    assert "every 1s" in table.stdout


@pytest.mark.anyio
async def test_restart_after_downtime_catches_up_per_policy(
    dsn: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """Stop every worker for 5+ ticks, start one: catch_up=30 enqueues each missed tick."""
    (tmp_path / "ticker.py").write_text(TICKER)
    worker = _spawn(tmp_path, dsn, "--queue", "other")
    try:
        first = await eventually(lambda: conn.fetchval("SELECT min(scheduled_at) FROM aioq.jobs"))
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    last = await conn.fetchval("SELECT last_tick FROM aioq.schedules WHERE name = 'tick'")
    await anyio.sleep(5.5)  # the downtime is the scenario: five ticks pass with nobody up
    restarted = await conn.fetchval("SELECT now()")
    worker = _spawn(tmp_path, dsn, "--queue", "other")
    try:
        await eventually(
            lambda: conn.fetchval("SELECT max(scheduled_at) >= $1 FROM aioq.jobs", restarted)
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    ticks = await ticks_of(conn, "tick")
    assert ticks[0] == first
    assert ticks == [first + timedelta(seconds=k) for k in range(len(ticks))]
    missed = [t for t in ticks if last < t < restarted]
    assert len(missed) >= 5


@pytest.mark.anyio
async def test_worker_cli_no_periodic(dsn: str, conn: asyncpg.Connection, tmp_path: Path) -> None:
    """--no-periodic (also passed on to --processes children) enqueues no tick."""
    (tmp_path / "ticker.py").write_text(TICKER)
    worker = _spawn(tmp_path, dsn, "--processes", "2", "--no-periodic", "--queue", "ticks")
    try:
        await eventually(lambda: _listening(conn, 2))  # both children serve
        await anyio.sleep(2.5)  # two ticks pass with nobody enqueueing them
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    assert await conn.fetchval("SELECT count(*) FROM aioq.schedules") == 0
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0


@pytest.mark.anyio
async def test_schedules_cli_shows_a_tick_never_enqueued_as_never(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @aioq.periodic(every=60)
    @registry.task(name="fresh")
    async def fresh() -> None: ...

    @aioq.periodic(every=60)
    @registry.task(name="ticked")
    async def ticked() -> None: ...

    now = utc(2026, 5, 4, 10, 17, 42)
    await scheduler(registry, conn).run_once(now)  # first sight of both: nothing enqueued
    only_ticked = Scheduler(schema="aioq", db=conn, schedules=[registry.schedules["ticked"]])
    await only_ticked.run_once(now + timedelta(seconds=18))  # 10:18 of 'ticked' enqueued
    listed = aioq_cli(dsn, "schedules", "--json")
    assert listed.returncode == 0, listed
    by_name = {s["name"]: s for s in json.loads(listed.stdout)}
    assert by_name["fresh"]["last_tick"] is None
    assert by_name["fresh"]["next_tick"] == "2026-05-04T10:18:00+00:00"
    assert datetime.fromisoformat(by_name["ticked"]["last_tick"]) == utc(2026, 5, 4, 10, 18)
    table = aioq_cli(dsn, "schedules")
    assert table.returncode == 0, table
    rows = {line.split()[0]: line.split() for line in table.stdout.splitlines()[1:]}
    assert rows["fresh"][5:] == ["never", "2026-05-04", "10:18:00Z"]
    assert rows["ticked"][5:] == ["2026-05-04", "10:18:00Z", "2026-05-04", "10:19:00Z"]


def test_schedules_cli_without_database_or_schema(dsn: str) -> None:
    assert_one_line_error(aioq_cli(None, "schedules"), "no database")
    empty = aioq_cli(dsn, "schedules")
    assert empty.returncode == 0, empty
    assert "(none)" in empty.stdout


# --- properties of the tick arithmetic ---

MOMENT = st.datetimes(
    min_value=datetime(2020, 1, 1), max_value=datetime(2030, 1, 1), timezones=st.just(UTC)
)


@settings(deadline=None)
@example(every=1, last=utc(2020, 1, 1), gap=10_002.0, catch_up=0.0)  # skipped count capped
@example(every=1, last=utc(2020, 1, 1), gap=10_001.0, catch_up=10_000.0)  # catch-up capped
@given(
    every=st.integers(min_value=1, max_value=7200),
    last=MOMENT,
    gap=st.floats(min_value=0, max_value=25_000),
    catch_up=st.floats(min_value=0, max_value=40_000),
)
def test_due_ticks_are_the_newest_ticks_after_last(
    every: int, last: datetime, gap: float, catch_up: float
) -> None:
    s = schedule_of(aioq.Registry(), every=every, catch_up=catch_up)
    last = s.latest(last) or last  # last_tick is always a tick
    now = last + timedelta(seconds=gap)
    ticks, skipped = s.due(last, now)
    all_missed = s.ticks(last, now, 10**9)
    if not all_missed:
        assert (ticks, skipped) == ([], 0)
        return
    # The latest tick is always due; the due ones are the newest missed ones, consecutive;
    # the skipped ones are the rest, all older than catch_up.
    assert ticks[-1] == all_missed[-1] == s.latest(now)
    assert ticks == all_missed[len(all_missed) - len(ticks) :]
    assert skipped == min(len(all_missed) - len(ticks), MAX_SKIPPED_COUNT)  # "at least N"
    assert all(t >= now - timedelta(seconds=catch_up) for t in ticks[:-1])
    if skipped and len(ticks) < MAX_CATCH_UP_TICKS:  # else the cap skipped the oldest
        assert all_missed[skipped - 1] < now - timedelta(seconds=catch_up)
