"""Scenario 6: the worker pool and ``defer`` through PgBouncer in transaction mode.

Our own PgBouncer (transaction pooling, 3 server connections for many more clients) sits in
front of the test database under an alias name that exists only in PgBouncer, so a client
that reached the server directly could not connect at all. Workers use it for their pool
(``--no-statement-cache``) and reach the server directly for their one LISTEN
(``--listen-dsn``). Skipped, with the reason, only if no pgbouncer binary can be found.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest
import statements
from harness import (
    HANG_GUARD,
    RUNS_TABLE,
    PgBouncer,
    WorkerProcess,
    fetch,
    find_pgbouncer,
    run_counts,
    run_times,
    scaled,
    tcp_connections,
    value,
    wait_for,
    write_tasks,
)
from waits import eventually

import aioq

pytestmark = pytest.mark.chaos

PGBOUNCER = find_pgbouncer()
ALIAS = "aioq_bounced"  # the name clients use; only PgBouncer knows it

TASKS = """
registry = aioq.Registry()
QUICK = aioq.Backoff(base=0.05, max=0.2)


@registry.task(name="bounce.work")
async def work(n: int) -> None:
    await record("ok")


@registry.task(name="bounce.flaky", retry=QUICK)
async def flaky(n: int) -> None:
    if aioq.current_job().attempt == 1:
        await record("fail")
        raise RuntimeError(f"flaky {n} fails its first attempt")
    await record("ok")


@registry.task(name="bounce.doomed", max_attempts=2, retry=QUICK)
async def doomed(n: int) -> None:
    await record("fail")
    raise RuntimeError(f"doomed {n} always fails")
"""

# The same names on the deferring side (only names and signatures matter there).
registry = aioq.Registry()


@registry.task(name="bounce.work")
async def work(n: int) -> None: ...


@registry.task(name="bounce.flaky")
async def flaky(n: int) -> None: ...


@registry.task(name="bounce.doomed", max_attempts=2)
async def doomed(n: int) -> None: ...


@pytest.fixture
def bouncer(dsn: str) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of this test's database, as ALIAS."""
    if PGBOUNCER is None:
        pytest.skip(
            "pgbouncer not found on PATH or in /usr/sbin: `apt-get install pgbouncer`"
            " (`make test` does it when run as root)"
        )
    user = urlsplit(dsn).username or "postgres"
    database = urlsplit(dsn).path.lstrip("/")
    with PgBouncer(PGBOUNCER, dsn, databases={ALIAS: database}, users=[user]) as running:
        yield running


async def bounced(bouncer: PgBouncer) -> asyncpg.Connection:
    """A client connection through PgBouncer: no prepared-statement cache."""
    return await asyncpg.connect(bouncer.dsn(ALIAS), statement_cache_size=0)


def test_defer_through_pgbouncer_is_transactional(dsn: str, bouncer: PgBouncer) -> None:
    """More clients than server connections defer, commit and roll back, concurrently."""
    clients, rounds = scaled(8, 16), scaled(30, 150)
    notified: list[str] = []

    async def client(conn: asyncpg.Connection) -> tuple[set[int], set[int]]:
        """Autocommit, commit, roll back, in turn; return (ids kept, ids rolled back)."""
        kept: set[int] = set()
        gone: set[int] = set()
        for i in range(rounds):
            rolled_back = i % 3 == 2
            call = work.options(queue="gone" if rolled_back else "kept")
            if i % 3 == 0:
                kept.add(await call.defer(conn, n=i))
                continue
            tx = conn.transaction()
            await tx.start()
            ids = {await call.defer(conn, n=i)}
            ids.update(await call.defer_many(conn, [{"n": j} for j in range(4)]))
            if rolled_back:
                await tx.rollback()
                gone |= ids
            else:
                await tx.commit()
                kept |= ids
        return kept, gone

    async def scenario() -> None:
        listener = await asyncpg.connect(dsn)  # direct: a pooler cannot hold a LISTEN
        await listener.add_listener("aioq:aioq", lambda *args: notified.append(args[-1]))
        # Wait on these queues as a sleeping worker does: only then do inserts ring.
        await statements.arm(listener, ["kept", "gone", "sentinel"])
        conns = [await bounced(bouncer) for _ in range(clients)]
        try:
            results = await asyncio.gather(*(client(c) for c in conns))
            kept = set().union(*(r[0] for r in results))
            gone = set().union(*(r[1] for r in results))
            rows = await conns[0].fetch("SELECT id, queue FROM aioq.jobs")
            assert {r["id"] for r in rows} == kept
            assert not kept & gone
            assert {r["queue"] for r in rows} == {"kept"}
            # Every notification sent before this one has arrived once it has.
            await work.options(queue="sentinel").defer(conns[0], n=0)
            await eventually(lambda: "sentinel" in notified, "the sentinel's doorbell", HANG_GUARD)
            assert "gone" not in notified
            assert "kept" in notified
        finally:
            for conn in (*conns, listener):
                await conn.close()

    asyncio.run(scenario())


def test_worker_processes_drain_retry_and_bury_through_pgbouncer(
    dsn: str, bouncer: PgBouncer, tmp_path: Path
) -> None:
    jobs, flaky_jobs, doomed_jobs = scaled(300, 10_000), scaled(20, 200), scaled(5, 20)
    fetch(dsn, RUNS_TABLE)
    module = write_tasks(tmp_path, "bouncetasks", TASKS)
    worker = WorkerProcess(
        f"{module}:registry",
        "--processes", "2", "--concurrency", "10", "--poll-interval", "0.5",
        "--no-statement-cache", "--listen-dsn", dsn,
        dsn=bouncer.dsn(ALIAS),
        cwd=tmp_path,
        env={"CHAOS_RECORD_DSN": dsn},
    )  # fmt: skip
    with worker:
        pids = worker.wait_listening(dsn, processes=2)
        # Where each connection goes (before any task opens its own): the only backends fed
        # by sockets of the worker processes are their two LISTENs; the pool's queries reach
        # the server through PgBouncer's sockets.
        backends = fetch(
            dsn,
            "SELECT application_name, client_port, current_setting('port')::int AS server_port"
            " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        worker_conns = set().union(*(tcp_connections(pid) for pid in pids))
        direct = [r[0] for r in backends if (r["client_port"], r["server_port"]) in worker_conns]
        assert len(direct) == 2
        assert all(name.startswith("aioq listener ") for name in direct), direct
        bouncer_conns = tcp_connections(bouncer.pid)
        assert any((r["client_port"], r["server_port"]) in bouncer_conns for r in backends)

        started = time.monotonic()

        async def defer_all() -> tuple[list[int], list[int], list[int], list[int]]:
            conn = await bounced(bouncer)
            try:
                async with conn.transaction():
                    work_ids = await work.defer_many(conn, [{"n": i} for i in range(jobs)])
                tx = conn.transaction()
                await tx.start()
                rolled_back = await work.defer_many(conn, [{"n": i} for i in range(50)])
                await tx.rollback()
                async with conn.transaction():
                    flaky_ids = [await flaky.defer(conn, n=i) for i in range(flaky_jobs)]
                doomed_ids = [await doomed.defer(conn, n=i) for i in range(doomed_jobs)]
                return work_ids, rolled_back, flaky_ids, doomed_ids
            finally:
                await conn.close()

        work_ids, rolled_back, flaky_ids, doomed_ids = asyncio.run(defer_all())

        def settled() -> bool:
            done = run_counts(dsn)
            dead = value(dsn, "SELECT count(*) FROM aioq.jobs WHERE status = 'dead'")
            return len(done) >= jobs + flaky_jobs and dead == doomed_jobs

        wait_for(settled, "every job to finish or die", on_timeout=worker.log)
        drained = time.monotonic() - started
        assert worker.stop() == 0, worker.log()[-3000:]

    ok = run_counts(dsn)
    failed = run_counts(dsn, "fail")
    assert set(ok) == set(work_ids) | set(flaky_ids)  # nothing lost, nothing rolled back ran
    assert set(ok.values()) == {1}  # nothing ran twice
    assert not set(rolled_back) & (set(ok) | set(failed))
    assert {i: failed.get(i) for i in flaky_ids} == dict.fromkeys(flaky_ids, 1)
    assert {i: failed.get(i) for i in doomed_ids} == dict.fromkeys(doomed_ids, 2)
    left = fetch(dsn, "SELECT id, status, attempts, last_error FROM aioq.jobs ORDER BY id")
    assert [r["id"] for r in left] == doomed_ids
    for row in left:
        assert (row["status"], row["attempts"]) == ("dead", 2)
        assert row["last_error"].startswith("RuntimeError: doomed ")
    log = worker.log()
    assert "prepared statement" not in log
    assert "failed; retrying" not in log  # no background loop hit a database error
    first_fail, ok_at = run_times(dsn, "fail"), run_times(dsn)
    retried = max((ok_at[i] - first_fail[i]).total_seconds() for i in flaky_ids)
    print(
        f"\npgbouncer: {jobs + flaky_jobs} jobs (+{doomed_jobs} dead) drained by 2 processes"
        f" x 10 through 3 server connections in {drained:.1f}s; lost 0, duplicates 0;"
        f" a failed first attempt succeeded again within {retried:.2f}s"
    )
