"""A long transaction (long profile only): while another session holds a REPEATABLE READ
snapshot open for 60 s, the drain goes on. Claim latency and the jobs table's dead tuples are
measured before, during and after, and printed."""

from __future__ import annotations

import statistics
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
    log,
    wait_for,
    wait_serving,
)

from aioq.dev.server import EmbeddedPostgres
from aioq.sql.jobs import CLAIM_ONE_QUEUE

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.skipif(not LONG, reason="long profile only (make chaos)"),
]

PROCESSES = 3
CONCURRENCY = 10
PHASES = (("before", 20.0), ("during", 60.0), ("after", 30.0))
FEED = 150  # jobs deferred per tick
TICK = 0.5
PROBE = CLAIM_ONE_QUEUE.text("aioq")
AUTOVACUUM_GUARD = 150.0
VACUUMS = (
    "SELECT autovacuum_count + vacuum_count FROM pg_stat_user_tables"
    " WHERE schemaname = 'aioq' AND relname = 'jobs'"
)
DEAD_TUPLES = (
    "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables"
    " WHERE schemaname = 'aioq' AND relname = 'jobs'"
)


def probe_claim(sql: Sql) -> float:
    """Time the workers' claim statement (10 jobs) in a transaction rolled back: seconds."""
    sql.execute("BEGIN")
    try:
        started = time.perf_counter()
        sql.fetch(PROBE, "default", 10, "chaos probe", [], 0.0)
        return time.perf_counter() - started
    finally:
        sql.execute("ROLLBACK")


def test_long_snapshot_during_drain(
    own_server: EmbeddedPostgres,
    own_dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    sql = open_sql(own_dsn)
    probe = Sql(own_dsn)
    holder = Sql(own_dsn)
    fleet = fleets(workdir, own_dsn, processes=PROCESSES, concurrency=CONCURRENCY)
    wait_serving(fleet, sql)
    jobs: list[int] = []
    samples: dict[str, dict[str, list[float]]] = {}
    started = time.monotonic()
    try:
        for phase, seconds in PHASES:
            if phase == "during":
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.value("SELECT count(*) FROM aioq.jobs")  # takes the snapshot
            got = samples[phase] = {
                "claim_ms": [],
                "dead": [],
                "done": [],
                "backlog": [],
                "seconds": [],
            }
            done_before = archived(sql)
            vacuums = sql.value(VACUUMS)
            phase_started = time.monotonic()
            end = phase_started + seconds

            def going(phase: str = phase, vacuums: int = vacuums, end: float = end) -> bool:
                # After the snapshot is gone, go on until autovacuum has been through the
                # table (its naptime is 60 s), so the figures show the dead tuples going away.
                if time.monotonic() < end:
                    return True
                if phase != "after" or sql.value(VACUUMS) > vacuums:
                    return False
                assert time.monotonic() < end + AUTOVACUUM_GUARD, "autovacuum never came"
                return True

            while going():
                jobs += defer(sql, FEED, max_sleep=0.02)
                got["claim_ms"].append(1000 * min(probe_claim(probe) for _ in range(3)))
                dead = sql.fetch(DEAD_TUPLES)[0]
                got["dead"].append(dead["n_dead_tup"])
                got["backlog"].append(len(jobs) - archived(sql))
                time.sleep(TICK)
            if phase == "after":  # once more, now that autovacuum has been through
                got["claim_ms"].append(1000 * min(probe_claim(probe) for _ in range(3)))
                got["dead"].append(sql.fetch(DEAD_TUPLES)[0]["n_dead_tup"])
            got["done"].append(archived(sql) - done_before)
            got["seconds"] = [time.monotonic() - phase_started]
            if phase == "during":
                horizon = sql.value(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL"
                    " AND state = 'idle in transaction'"
                )
                assert horizon >= 1, "the snapshot was not held"
                holder.execute("COMMIT")
    finally:
        holder.close()
        probe.close()
    wait_for(lambda: archived(sql) == len(jobs), f"{len(jobs)} jobs archived")
    wall = time.monotonic() - started
    assert fleet.stop() == 0
    figures = {}
    for phase, got in samples.items():
        claim = sorted(got["claim_ms"])
        figures[phase] = {
            "claim_ms_median": round(statistics.median(claim), 2),
            "claim_ms_p95": round(claim[int(0.95 * (len(claim) - 1))], 2),
            "claim_ms_max": round(claim[-1], 2),
            "dead_tup_first": got["dead"][0],
            "dead_tup_max": max(got["dead"]),
            "dead_tup_last": got["dead"][-1],
            "backlog_max": max(got["backlog"]),
            "seconds": round(got["seconds"][0], 1),
            "completed_per_s": round(got["done"][0] / got["seconds"][0], 1),
        }
        log(f"{phase}: {figures[phase]}")
    # The drain went on while the snapshot was held.
    assert figures["during"]["completed_per_s"] > 0
    lost, duplicates, bound = check_drained(sql, jobs, [Fault(0, 0, set(), "snapshot")])
    Result(
        "9 long transaction",
        len(jobs),
        PROCESSES,
        CONCURRENCY,
        1,
        lost,
        duplicates,
        bound,
        [],
        wall,
        notes=figures,
    ).report()
