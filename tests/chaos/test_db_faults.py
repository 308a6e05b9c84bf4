"""Database faults: PostgreSQL restarted mid-drain; every worker connection terminated, again
and again. The workers must ride them out: no child exits, none is replaced."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import (
    LONG,
    Fault,
    Result,
    Sql,
    WorkerProcess,
    archived,
    check_drained,
    defer,
    first_completion_after,
    jitter,
    lease_lost_reports,
    listening_pids,
    log,
    pending,
    running_ids,
    wait_for,
    wait_serving,
)

from aioq.dev.server import EmbeddedPostgres

pytestmark = pytest.mark.chaos

PROCESSES = 3
CONCURRENCY = 10
RESTARTS = 3 if LONG else 1
RESTART_JOBS = 6000 if LONG else 1500
TERMINATIONS = 20 if LONG else 5
TERMINATE_JOBS = 8000 if LONG else 2000
TERMINATE_INTERVAL = 0.7


def no_restarts(fleet: WorkerProcess) -> None:
    restarted = [m for m in fleet.messages(fleet.pid) if "restarting it" in m]
    assert not restarted, restarted


def test_postgres_restart_mid_drain(
    own_server: EmbeddedPostgres,
    own_dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    """``pg_ctl restart -m fast`` while 3 processes drain; they reconnect (pool, LISTEN)."""
    sql = open_sql(own_dsn)
    jobs = defer(sql, RESTART_JOBS, max_sleep=0.1)
    fleet = fleets(workdir, own_dsn, processes=PROCESSES, concurrency=CONCURRENCY)
    pids = wait_serving(fleet, sql)
    started = time.monotonic()
    faults: list[Fault] = []
    done = 0
    for n in range(RESTARTS):
        # Restart once a share of the backlog is done, so every restart hits a busy queue.
        target = len(jobs) * (n + 1) // (RESTARTS + 2)
        wait_for(lambda target=target: archived(sql) >= target, f"{target} jobs done", 120)
        in_flight = running_ids(sql)
        assert pending(sql) > 0, "the queue drained before the restart: add jobs"
        at = time.time()
        own_server.restart()
        ended = time.time()
        log(f"restart {n + 1}: PostgreSQL down and up in {ended - at:.2f}s")
        sql.retrying(lambda: sql.value("SELECT 1"))
        # Claims committed just before the shutdown whose replies were lost are running too.
        in_flight |= sql.retrying(lambda: running_ids(sql))
        faults.append(Fault(at, ended, in_flight, note="restart"))
        assert fleet.children() == pids, "a worker exited during the restart"
        done = sql.retrying(lambda: archived(sql))
        wait_for(lambda done=done: archived(sql) > done, "a job completed after the restart", 60)
        wait_for(lambda: listening_pids_ok(sql, pids), "every worker LISTENing again", 60)

    wait_for(lambda: archived(sql) == len(jobs), f"{len(jobs)} jobs archived")
    wall = time.monotonic() - started
    assert fleet.children() == pids, "a worker exited or was replaced"
    no_restarts(fleet)
    recover = [first_completion_after(sql, f.ended) or -1.0 for f in faults]
    assert fleet.stop() == 0
    lost, duplicates, bound = check_drained(sql, jobs, faults, fleet)
    lease_lost = lease_lost_reports(fleet, sql)
    Result(
        "2 postgres restart",
        len(jobs),
        PROCESSES,
        CONCURRENCY,
        len(faults),
        lost,
        duplicates,
        bound,
        recover,
        wall,
        notes={
            **lease_lost,
            "downtime_s": [round(f.ended - f.started, 2) for f in faults],
            "recover": "server up again -> first job completed",
        },
    ).report()


def listening_pids_ok(sql: Sql, pids: set[int]) -> bool:
    return listening_pids(sql) >= pids


TERMINATE = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'aioq %'
"""


def test_backends_terminated_repeatedly(
    dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    """``pg_terminate_backend`` on every aioq connection (pool and LISTEN), every ~1 s."""
    sql = open_sql(dsn)
    jobs = defer(sql, TERMINATE_JOBS, max_sleep=0.2)
    fleet = fleets(workdir, dsn, processes=PROCESSES, concurrency=CONCURRENCY)
    pids = wait_serving(fleet, sql)
    started = time.monotonic()
    faults: list[Fault] = []
    terminated = 0
    for _ in range(TERMINATIONS):
        time.sleep(jitter(TERMINATE_INTERVAL))
        assert pending(sql) > 0, "the queue drained before the last termination: add jobs"
        before = running_ids(sql)
        at = time.time()
        killed = sql.value(TERMINATE)
        assert killed > 0, "no aioq connection to terminate"
        terminated += killed
        # A claim that committed as its connection died is running, its reply lost.
        faults.append(Fault(at, at, before | running_ids(sql), note="terminate"))
    log(f"terminated {terminated} connections in {len(faults)} rounds")

    wait_for(lambda: archived(sql) == len(jobs), f"{len(jobs)} jobs archived")
    wall = time.monotonic() - started
    assert fleet.children() == pids, "a worker exited or was replaced"
    no_restarts(fleet)
    wait_for(lambda: listening_pids_ok(sql, pids), "every worker LISTENing again", 60)
    recover = [first_completion_after(sql, f.ended) or -1.0 for f in faults]
    assert fleet.stop() == 0
    lost, duplicates, bound = check_drained(sql, jobs, faults, fleet)
    lease_lost = lease_lost_reports(fleet, sql)
    Result(
        "3 backend termination",
        len(jobs),
        PROCESSES,
        CONCURRENCY,
        len(faults),
        lost,
        duplicates,
        bound,
        recover,
        wall,
        notes={
            **lease_lost,
            "connections_terminated": terminated,
            "recover": "termination -> next job completed",
        },
    ).report()
