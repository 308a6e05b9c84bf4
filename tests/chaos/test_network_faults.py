"""Network faults between the workers and PostgreSQL, through a TCP proxy of the test's own:
every connection dropped; all traffic stalled for seconds; the open connections blackholed for
good (open, silent) while new ones work. Workers recover without a restart, and never hang."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import (
    LONG,
    Fault,
    Proxy,
    Result,
    Sql,
    WorkerProcess,
    archived,
    check_drained,
    defer,
    first_completion_after,
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
JOBS = 12000 if LONG else 2000
ROUNDS = 3 if LONG else 1
STALL = 10.0 if LONG else 2.0
# A blackholed connection is noticed when a statement on it times out (--command-timeout);
# asyncpg then waits as long again for the server to acknowledge a cancel before closing it.
COMMAND_TIMEOUT = 2.0
RECOVER_GUARD = 120.0


def test_network_drop_stall_blackhole(
    own_server: EmbeddedPostgres,
    own_dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    sql = open_sql(own_dsn)
    jobs = defer(sql, JOBS, max_sleep=0.2)
    with Proxy("127.0.0.1", own_server.port) as proxy:
        proxied = own_dsn.replace(f":{own_server.port}/", f":{proxy.port}/")
        fleet = fleets(
            workdir,
            proxied,
            record_dsn=own_dsn,
            processes=PROCESSES,
            concurrency=CONCURRENCY,
            extra=("--command-timeout", str(COMMAND_TIMEOUT)),
        )
        pids = wait_serving(fleet, sql)
        started = time.monotonic()
        faults: list[Fault] = []
        recover: dict[str, list[float]] = {"drop": [], "stall": [], "blackhole": []}

        def inject(kind: str, act: Callable[[], object], settle: Callable[[], None]) -> None:
            assert pending(sql) > 0, f"the queue drained before the {kind}: add jobs"
            before = running_ids(sql)
            at = time.time()
            what = act()
            settle()
            ended = time.time()
            faults.append(Fault(at, ended, before | running_ids(sql), note=kind))
            # Recovered: a job completes after the fault ended, and every worker LISTENs again.
            done = archived(sql)
            wait_for(
                lambda: archived(sql) > done, f"a job completed after the {kind}", RECOVER_GUARD
            )
            wait_for(
                lambda: listening_pids(sql) >= pids, f"LISTEN back after the {kind}", RECOVER_GUARD
            )
            took = (first_completion_after(sql, ended) or 0.0) + (ended - at)
            recover[kind].append(took)
            log(f"{kind} ({what}): recovered in {took:.2f}s")
            assert fleet.children() == pids, f"a worker exited during the {kind}"

        for _ in range(ROUNDS):
            inject("drop", proxy.drop_all, lambda: None)
            inject(
                "stall",
                lambda: proxy.stall(STALL),
                lambda: wait_for(proxy.flowing, "the stall to end", STALL + 30),
            )
            inject("blackhole", proxy.blackhole, lambda: None)

        wait_for(lambda: archived(sql) == len(jobs), f"{len(jobs)} jobs archived")
        wall = time.monotonic() - started
        assert fleet.children() == pids, "a worker exited or was replaced"
        restarted = [m for m in fleet.messages(fleet.pid) if "restarting it" in m]
        assert not restarted, restarted
        assert fleet.stop() == 0
        lease_lost = lease_lost_reports(fleet, sql)
    lost, duplicates, bound = check_drained(sql, jobs, faults, fleet)
    Result(
        "5 network drop/stall/blackhole",
        len(jobs),
        PROCESSES,
        CONCURRENCY,
        len(faults),
        lost,
        duplicates,
        bound,
        [t for times in recover.values() for t in times],
        wall,
        notes={
            **lease_lost,
            "recover_by_kind": {k: [round(t, 2) for t in v] for k, v in recover.items()},
            "stall_s": STALL,
            "recover": "fault start -> first job completed after it ended",
        },
    ).report()
