"""Failover: the primary is killed mid-drain and its streaming standby promoted.

A real primary and a synchronous streaming standby (``pg_basebackup -R``), both embedded; the
workers (``aioq worker --processes 2``) and the test reach them through one multi-host DSN with
``target_session_attrs=read-write``. The primary is SIGKILLed while jobs run, the standby is
promoted, and the workers must find it on their own: pool and LISTEN reconnect with backoff,
no worker process exits, every committed job completes, and only jobs in flight at the switch
may run twice (their leases bring them back).

Replication is synchronous (``synchronous_standby_names = '*'``): a commit is acknowledged once
the standby has it, so "committed" means "on the standby". With asynchronous replication the
last commits before a crash can be missing after promotion: that is PostgreSQL's trade-off,
not something a queue can undo.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
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
    lease_lost_reports,
    listening_pids,
    log,
    pending,
    running_ids,
    wait_for,
    wait_serving,
)

import aioq
from aioq.dev.server import EmbeddedPostgres

pytestmark = pytest.mark.chaos

PROCESSES = 2
CONCURRENCY = 8
JOBS = 4000 if LONG else 800
# Seconds with no primary at all (the old one dead, the standby not yet promoted): the workers
# keep failing to connect (refused, or a read-only server) and must back off, not give up.
NO_PRIMARY = 5.0 if LONG else 2.0
STREAMING = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
# The `sleep` argument of the jobs the application defers during the failover: five decimals,
# which the chaos defer's (rounded to four) never have.
MARK = 0.00123

app = aioq.Registry()


@app.task(name="record")  # the chaos tasks' "record", as the application defers it
async def record(sleep: float = 0.0) -> None:
    raise AssertionError("runs in the workers, not here")


class Deferrer(threading.Thread):
    """The application: defers jobs through an asyncpg pool on the multi-host DSN, throughout."""

    def __init__(self, dsn: str) -> None:
        super().__init__(name="deferrer", daemon=True)
        self.dsn = dsn
        self.acknowledged: list[int] = []  # defer returned: committed
        self.failed = 0  # defer raised: nothing committed, or a commit whose reply was lost
        self.acknowledged_at: list[float] = []
        self.errors: set[str] = set()
        self.done = threading.Event()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        async with asyncpg.create_pool(self.dsn, min_size=1, max_size=2, timeout=5) as pool:
            while not self.done.is_set():
                try:
                    self.acknowledged.append(await record.defer(pool, sleep=MARK))
                    self.acknowledged_at.append(time.time())
                except Exception as exc:  # asyncpg raises a zoo of types when a server dies
                    self.failed += 1
                    self.errors.add(type(exc).__name__)
                await asyncio.sleep(0.01)


@pytest.fixture
def servers() -> Iterator[tuple[EmbeddedPostgres, EmbeddedPostgres]]:
    """A primary and its synchronous streaming standby."""
    # fsync off for speed (we kill processes, not the machine), but commits wait for the
    # standby: the embedded server's test default, synchronous_commit=off, would not.
    primary = EmbeddedPostgres(fsync=False, settings={"synchronous_commit": "on"})
    with primary, EmbeddedPostgres(fsync=False, standby_of=primary) as standby:
        yield primary, standby


def multi_host(primary: EmbeddedPostgres, standby: EmbeddedPostgres, database: str) -> str:
    return (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/{database}"
        "?target_session_attrs=read-write"
    )


def test_primary_killed_standby_promoted_mid_drain(
    servers: tuple[EmbeddedPostgres, EmbeddedPostgres],
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
) -> None:
    primary, standby = servers
    database = f"aioq_failover_{secrets.token_hex(4)}"
    admin = Sql(primary.dsn)
    try:
        admin.execute(f'CREATE DATABASE "{database}"')
        wait_for(lambda: admin.value(STREAMING) == 1, "the standby streaming", 60)
        admin.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        admin.execute("SELECT pg_reload_conf()")
        wait_for(
            lambda: admin.value("SELECT sync_state FROM pg_stat_replication") == "sync",
            "the standby synchronous",
            60,
        )
    finally:
        admin.close()
    dsn = multi_host(primary, standby, database)
    sql = open_sql(dsn)  # follows the primary: the multi-host DSN, reconnecting when dropped
    sql._run(aioq.install)
    jobs = defer(sql, JOBS, max_sleep=0.2)
    fleet = fleets(workdir, dsn, processes=PROCESSES, concurrency=CONCURRENCY)
    pids = wait_serving(fleet, sql)
    started = time.monotonic()
    deferrer = Deferrer(dsn)
    deferrer.start()

    wait_for(lambda: archived(sql) >= JOBS // 3, f"{JOBS // 3} jobs done", 120)
    in_flight = running_ids(sql)
    assert pending(sql) > 0, "the queue drained before the failover: add jobs"
    killed_at = time.time()
    primary.kill()
    time.sleep(NO_PRIMARY)
    standby.promote()
    promoted_at = time.time()
    log(f"primary killed, standby promoted {promoted_at - killed_at:.2f}s later")
    # Claims committed (so replicated) after our look at running jobs are in flight too.
    in_flight |= sql.retrying(lambda: running_ids(sql))
    fault = Fault(killed_at, promoted_at, in_flight, note="failover")
    wait_for(lambda: sql.retrying(lambda: archived(sql)) > 0, "the new primary answering", 60)
    done = archived(sql)
    wait_for(lambda: archived(sql) > done, "a job completed on the new primary", 60)
    wait_for(lambda: listening_pids(sql) >= pids, "every worker LISTENing on the new primary", 60)
    relisten = time.time() - promoted_at
    assert fleet.children() == pids, "a worker exited during the failover"
    wait_for(
        lambda: sum(t > promoted_at for t in deferrer.acknowledged_at) >= 20,
        "the application deferring on the new primary",
        60,
    )
    deferrer.done.set()
    deferrer.join(30)
    assert not deferrer.is_alive()
    # Every acknowledged defer is a job; a defer that raised may have committed all the same
    # (its reply lost with the primary): such jobs run too, and are few.
    marked = {
        r["id"]
        for r in sql.fetch(
            "SELECT id FROM aioq.jobs WHERE args->>'sleep' = $1"
            " UNION SELECT id FROM aioq.archive WHERE args->>'sleep' = $1",
            str(MARK),
        )
    }
    assert set(deferrer.acknowledged) <= marked, "an acknowledged defer was lost"
    unacknowledged = marked - set(deferrer.acknowledged)
    assert len(unacknowledged) <= deferrer.failed
    assert not marked & set(jobs)
    jobs += sorted(marked)

    wait_for(lambda: archived(sql) == len(jobs), f"{len(jobs)} jobs archived")
    wall = time.monotonic() - started
    assert fleet.children() == pids, "a worker exited or was replaced"
    restarted = [m for m in fleet.messages(fleet.pid) if "restarting it" in m]
    assert not restarted, restarted
    resume = first_completion_after(sql, promoted_at)
    assert resume is not None
    assert fleet.stop() == 0
    lost, duplicates, bound = check_drained(sql, jobs, [fault], fleet)
    troubles = [r for r in fleet.records() if r.get("level") in ("WARNING", "ERROR")]
    for record in troubles[:4]:
        log(f"  {record.get('level')} {record.get('process')} {record.get('message')[:200]}")
    Result(
        "failover",
        len(jobs),
        PROCESSES,
        CONCURRENCY,
        1,
        lost,
        duplicates,
        bound,
        [resume],
        wall,
        notes={
            **lease_lost_reports(fleet, sql),
            "kill_to_promoted_s": round(promoted_at - killed_at, 2),
            "relisten_after_promotion_s": round(relisten, 2),
            "in_flight": len(in_flight),
            "app_defers_acknowledged": len(deferrer.acknowledged),
            "app_defers_failed": deferrer.failed,
            "app_defer_errors": sorted(deferrer.errors),
            "app_defers_committed_unacknowledged": len(unacknowledged),
            "recover": "standby promoted -> first job completed on it",
        },
    ).report()
