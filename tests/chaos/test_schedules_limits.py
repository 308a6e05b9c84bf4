"""Periodic jobs and queue limits under process faults.

* Worker processes SIGKILLed right as ticks fall due: still exactly one job per tick, no gap.
* A worker holding jobs of a queue with ``max_running`` SIGKILLed: the limit holds throughout
  (sampled in the database), its jobs are rescued by the reaper and nothing is lost.
"""

from __future__ import annotations

import os
import random
import signal
import textwrap
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from harness import (
    LONG,
    Fault,
    Result,
    Sql,
    WorkerProcess,
    archived,
    backends_of,
    check_drained,
    defer,
    listening_pids,
    log,
    running_ids,
    wait_for,
    wait_serving,
)

pytestmark = pytest.mark.chaos

TICK_KILLS = 12 if LONG else 4
MAX_RUNNING = 3

TICKER = textwrap.dedent(
    """
    import aioq
    from chaostasks import registry


    @aioq.periodic(every=1, catch_up=60)
    @registry.task(name="tick", queue="ticks")
    async def tick() -> None:
        pass
    """
)


def test_sigkill_as_ticks_fall_due(
    dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    """Kill a worker a few milliseconds after a tick falls due, again and again: each tick is
    enqueued once by whoever gets there (the tick jobs wait in a queue nobody serves)."""
    sql = open_sql(dsn)
    (workdir / "chaosticks.py").write_text(TICKER)
    # Serving only `default` (a worker serves all its registry's queues by default).
    fleet = fleets(
        workdir, dsn, processes=3, target="chaosticks:registry", extra=["--queue", "default"]
    )
    wait_serving(fleet, sql)
    wait_for(lambda: sql.value("SELECT count(*) FROM aioq.jobs") >= 2, "the first ticks", 30)
    kills = 0
    while kills < TICK_KILLS:
        serving = fleet.children() & listening_pids(sql)
        if len(serving) < 3:  # let the supervisor bring the last victim back first
            time.sleep(0.05)
            continue
        now = time.time()
        time.sleep(1 - now % 1 + random.uniform(0.001, 0.02))  # just after a tick (same host)
        victim = random.choice(sorted(serving))
        os.kill(victim, signal.SIGKILL)
        kills += 1
        wait_for(lambda v=victim: backends_of(sql, v) == 0, f"pid {victim}'s connections gone", 60)
    last_kill = sql.value("SELECT now()")
    wait_for(
        lambda: (
            sql.value("SELECT max(scheduled_at) FROM aioq.jobs") > last_kill + timedelta(seconds=2)
        ),
        "ticks after the last kill",
        60,
    )
    # The last victim may still be waiting out its restart backoff: a stop then would report
    # its crash (the supervisor's status is that of each child's last run).
    wait_for(lambda: len(fleet.children() & listening_pids(sql)) == 3, "the last victim back", 60)
    assert fleet.stop() == 0
    rows = sql.fetch(
        "SELECT scheduled_at, count(*) AS n FROM aioq.jobs GROUP BY scheduled_at ORDER BY 1"
    )
    ticks = [r["scheduled_at"] for r in rows]
    assert all(r["n"] == 1 for r in rows), [dict(r) for r in rows if r["n"] != 1]
    assert ticks == [ticks[0] + timedelta(seconds=k) for k in range(len(ticks))], ticks
    restarted = [m for m in fleet.messages() if "was killed by SIGKILL; restarting" in m]
    assert len(restarted) == TICK_KILLS
    log(f"RESULT tick sigkill: {TICK_KILLS} kills over {len(ticks)} ticks, one job each, no gap")


def test_sigkill_under_max_running_rescues_and_holds_the_limit(
    dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    sql = open_sql(dsn)
    sql.execute("INSERT INTO aioq.queues (name, max_running) VALUES ('default', $1)", MAX_RUNNING)
    jobs = defer(sql, 200 if LONG else 60, max_sleep=0.3)
    started = time.monotonic()
    fleet = fleets(workdir, dsn, processes=3, concurrency=10)
    wait_serving(fleet, sql)
    samples: list[int] = []
    faults: list[Fault] = []
    deadline = time.monotonic() + 120
    count = "SELECT count(*) FROM aioq.jobs WHERE status = 'running'"
    while archived(sql) < len(jobs):
        assert time.monotonic() < deadline, "the queue did not drain"
        samples.append(sql.value(count))
        # Until a kill caught a job in flight: the victim may end its job between the look
        # and the kill (jobs last 0.3 s at most), and that kill proves nothing.
        if not any(f.in_flight for f in faults) and archived(sql) >= 10:
            holders = [p for p in fleet.children() if running_ids(sql, p)]
            if holders:
                victim = holders[0]
                at = time.time()
                os.kill(victim, signal.SIGKILL)
                wait_for(lambda v=victim: backends_of(sql, v) == 0, f"pid {victim} gone", 60)
                faults.append(Fault(at, at, running_ids(sql, victim), note=f"SIGKILL {victim}"))
                log(f"killed {victim} holding {sorted(faults[-1].in_flight)}")
        time.sleep(0.02)
    wall = time.monotonic() - started
    assert any(f.in_flight for f in faults), "no kill caught a job in flight: add jobs"
    assert max(samples) <= MAX_RUNNING, max(samples)
    assert max(samples) == MAX_RUNNING  # the limit was reached, not just respected
    assert fleet.stop() == 0
    lost, duplicates, bound = check_drained(sql, jobs, faults, fleet)
    Result(
        "max_running sigkill",
        len(jobs),
        3,
        10,
        len(faults),
        lost,
        duplicates,
        bound,
        [],
        wall,
        notes={"max_running": MAX_RUNNING, "max_sampled_running": max(samples)},
    ).report()
