"""The per-minute history and the workers' rows: written by workers, read by the dashboard."""

from __future__ import annotations

import math
from collections.abc import Callable

import anyio
import asyncpg
import pytest
from procs import aioq_cli
from starlette.testclient import TestClient
from waits import until_sql

import aioq
import aioq.web
from aioq.job import Claim, OutcomeKind
from aioq.worker.history import BUCKETS, StatsRecorder, StatsWriter, bucket, percentile

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0
QUICK = aioq.Backoff(base=0.01, factor=1, max=0.01, jitter=0)
MakeWorker = Callable[..., aioq.Worker]


def claim(queue: str = "q", task: str = "t", waited: float = 0.0) -> Claim:
    return Claim(
        id=1, number=1, queue=queue, task=task, args="{}", priority=0, attempt=1, max_attempts=3,
        lease=30.0, waited=waited,
    )  # fmt: skip


async def history(conn: asyncpg.Connection) -> dict[tuple[str, str], tuple[int, int, int, int]]:
    rows = await conn.fetch(
        "SELECT queue, task, sum(completed) AS c, sum(retried) AS r, sum(dead) AS d,"
        " sum((SELECT sum(x) FROM unnest(run_hist) AS x)) AS n"
        " FROM aioq.stats_history GROUP BY queue, task"
    )
    return {(r["queue"], r["task"]): (r["c"], r["r"], r["d"], r["n"]) for r in rows}


async def until_settled(conn: asyncpg.Connection) -> None:
    """Wait until no job is pending or running."""
    await until_sql(
        conn, "SELECT NOT EXISTS (SELECT FROM aioq.jobs WHERE status IN ('pending', 'running'))"
    )


def test_buckets_and_percentiles() -> None:
    assert bucket(0.0) == 0
    assert bucket(0.005) == 0  # upper bounds are inclusive
    assert bucket(0.006) == 1
    assert bucket(10_000) == len(BUCKETS)
    hist = [0] * (len(BUCKETS) + 1)
    assert percentile(hist, 0.5) is None
    hist[bucket(0.02)] = 90
    hist[bucket(4.0)] = 10
    assert percentile(hist, 0.5) == 0.025
    assert percentile(hist, 0.95) == 5
    hist[-1] = 1000
    assert percentile(hist, 0.95) == math.inf  # "more than an hour"
    hist[-1] = 0
    hist[bucket(1800)] = 1000
    assert percentile(hist, 0.95) == 3600


def test_recorder_counts_outcomes_not_snoozes() -> None:
    recorder = StatsRecorder()
    recorder.observe(claim(waited=0.2), OutcomeKind.SUCCEEDED, 0.003)
    recorder.observe(claim(), OutcomeKind.RETRIED, 1.5)
    recorder.observe(claim(task="u"), OutcomeKind.DEAD, 1.5)
    recorder.observe(claim(), OutcomeKind.SNOOZED, 0.1)
    recorder.observe(claim(), OutcomeKind.RELEASED, 0.1)
    counts = recorder.take()
    assert recorder.counts == {}
    t, u = counts["q", "t"], counts["q", "u"]
    assert (t.completed, t.retried, t.dead, u.dead) == (1, 1, 0, 1)
    assert sum(t.run) == 2
    assert t.wait[bucket(0.2)] == 1
    assert t.run[bucket(0.003)] == 1


async def test_writer_adds_up_a_minute_gives_back_on_failure_and_prunes(
    conn: asyncpg.Connection, dsn: str
) -> None:
    recorder = StatsRecorder()

    def writer(db: asyncpg.Connection) -> StatsWriter:
        return StatsWriter(
            schema="aioq", db=db, recorder=recorder, worker_id="w1", queues=["q"], concurrency=4,
            retention=3600,
        )  # fmt: skip

    broken = await asyncpg.connect(dsn)
    await broken.close()
    recorder.observe(claim(), OutcomeKind.SUCCEEDED, 0.01)
    with pytest.raises(asyncpg.InterfaceError):
        await writer(broken).run_once()
    assert recorder.counts["q", "t"].completed == 1  # kept for the next write

    recorder.observe(claim(), OutcomeKind.SUCCEEDED, 0.01)
    assert await writer(conn).run_once() == 1
    recorder.observe(claim(), OutcomeKind.DEAD, 0.01)
    await writer(conn).run_once()  # same minute (most likely): added to the same row
    assert await history(conn) == {("q", "t"): (2, 0, 1, 3)}
    row = await conn.fetchrow("SELECT * FROM aioq.workers")
    assert (row["id"], row["queues"], row["concurrency"]) == ("w1", ["q"], 4)

    await conn.execute(
        "INSERT INTO aioq.stats_history VALUES (now() - interval '2 hours', 'old', 'q', 't',"
        " 5, 0, 0, '{}', '{}');"
        "INSERT INTO aioq.workers (id, host, pid, queues, concurrency, last_seen)"
        " VALUES ('gone', 'h', 1, '{q}', 1, now() - interval '2 hours');"
        # Half hours that ended before the retention (one hour) go; one that overlaps it stays.
        "INSERT INTO aioq.stats_rollup VALUES (now() - interval '100 minutes', 'q', 'old',"
        " 5, 0, 0, '{}', '{}'), (now() - interval '80 minutes', 'q', 'kept', 5, 0, 0, '{}', '{}')"
    )
    await writer(conn).run_once()
    assert await history(conn) == {("q", "t"): (2, 0, 1, 3)}
    assert await conn.fetchval("SELECT array_agg(id) FROM aioq.workers") == ["w1"]
    assert await conn.fetchval("SELECT array_agg(task ORDER BY task) FROM aioq.stats_rollup") == [
        "kept",
        "t",
    ]


async def test_a_cancel_never_interrupts_the_write(conn: asyncpg.Connection) -> None:
    # Interrupted after its commit, a write would give its counts back and write them twice
    # (seen as 28 completions of 20 jobs when a stopping worker was cancelled mid-write).
    recorder = StatsRecorder()
    writer = StatsWriter(
        schema="aioq", db=conn, recorder=recorder, worker_id="w1",
        queues=["q"], concurrency=1,
    )  # fmt: skip
    recorder.observe(claim(), OutcomeKind.SUCCEEDED, 0.01)
    with anyio.CancelScope() as scope:
        scope.cancel()  # already cancelled when the write starts
        await writer.run_once()
    assert recorder.counts == {}
    assert await history(conn) == {("q", "t"): (1, 0, 0, 1)}


async def test_workers_record_every_outcome_and_aioq_stats_shows_failures(
    conn: asyncpg.Connection, dsn: str, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="ok")
    async def ok(n: int) -> None:
        await anyio.sleep(0.01)

    @registry.task(name="bad", max_attempts=2, retry=QUICK, lease=1.0)
    async def bad(n: int) -> None:
        raise ValueError(f"bad {n}")

    await ok.defer_many(conn, [{"n": i} for i in range(20)])
    await bad.defer_many(conn, [{"n": i} for i in range(3)])
    workers = [
        make_worker(concurrency=3, heartbeat_interval=0.2, stats_interval=0.2) for _ in range(3)
    ]
    async with workers[0], workers[1]:
        # The third one is hard-cancelled: its counts are still written on the way out.
        with anyio.CancelScope() as hard:
            async with anyio.create_task_group() as tg:
                tg.start_soon(workers[2].run)
                await until_sql(conn, "SELECT count(*) >= 3 FROM aioq.workers")
                seen = await conn.fetch("SELECT id, queues, concurrency FROM aioq.workers")
                assert {r["id"] for r in seen} == {w.id for w in workers}
                assert all(r["queues"] == ["default"] and r["concurrency"] == 3 for r in seen)
                await until_settled(conn)
                hard.cancel()
    # A clean stop removes the worker's row; the hard-cancelled one removed its own too.
    assert await conn.fetchval("SELECT count(*) FROM aioq.workers") == 0
    assert await history(conn) == {
        ("default", "ok"): (20, 0, 0, 20),
        ("default", "bad"): (0, 3, 3, 6),
    }

    snapshot = await aioq.admin.stats(conn)
    (default,) = snapshot.queues
    assert default.failed_last_minute == 6
    assert default.dead == 3
    # Completions too come from the history: the workers kept nothing in the archive.
    assert default.completed_last_minute == 20
    assert not snapshot.archived
    shown = await anyio.to_thread.run_sync(lambda: aioq_cli(dsn, "stats").stdout.splitlines())
    assert shown[0].split()[-2:] == ["COMPLETED_1M", "FAILED_1M"]
    assert shown[1].split()[0] == "default"
    assert shown[1].split()[-2:] == ["20", "6"]

    with TestClient(aioq.web.app(dsn=dsn)) as client:
        for name in ("hour", "day"):
            page = client.get(f"/throughput?range={name}")
            assert page.status_code == 200
            assert "<svg" in page.text
            totals = page.text.split('id="totals"')[1]
            assert '<td class="mono">ok</td>' in totals
            assert '<td class="num">20</td>' in totals
            assert '<td class="num warn">3</td>' in totals
            assert '<td class="num bad">3</td>' in totals
        assert "No history" not in client.get("/throughput").text
        assert 'aria-label="outcomes of default"' in client.get("/throughput").text
        per_task = client.get("/throughput?queue=default&range=day").text
        assert 'aria-label="outcomes of ok"' in per_task
        assert 'aria-label="outcomes of bad"' in per_task
        assert "No history" in client.get("/throughput?queue=elsewhere").text


async def test_history_can_be_turned_off(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="ok")
    async def ok() -> None:
        pass

    await ok.defer(conn)
    with anyio.fail_after(HANG_GUARD):
        await make_worker(stats_history=False).run_until_idle()
    assert await conn.fetchval("SELECT count(*) FROM aioq.stats_history") == 0
    assert await conn.fetchval("SELECT count(*) FROM aioq.workers") == 0
    assert (await aioq.admin.stats(conn)).queues == ()
    with pytest.raises(aioq.errors.ConfigError, match="stats_interval"):
        make_worker(stats_interval=0)


async def test_a_schema_without_history_tables_only_costs_a_warning(
    conn: asyncpg.Connection,
    registry: aioq.Registry,
    make_worker: MakeWorker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @registry.task(name="ok")
    async def ok() -> None:
        pass

    await conn.execute("DROP TABLE aioq.stats_history")
    await ok.defer(conn)
    with anyio.fail_after(HANG_GUARD):
        await make_worker(stats_interval=0.05).run_until_idle()
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
    warnings = [r for r in caplog.records if "writes no stats history" in r.message]
    assert len(warnings) == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


# The half-hour rollup the day view reads -----------------------------------------------------

Rollup = dict[tuple[object, str, str], tuple[int, int, int, list[int], list[int]]]


async def rollup_of_history(
    conn: asyncpg.Connection | asyncpg.Pool, schema: str = "aioq"
) -> Rollup:
    """What the rollup must hold: the minute rows summed per half hour, queue and task."""
    summed: Rollup = {}
    for r in await conn.fetch(
        "SELECT date_bin('30 minutes', minute, timestamptz '2000-01-01') AS half, *"
        f" FROM {schema}.stats_history"
    ):
        key = (r["half"], r["queue"], r["task"])
        c, re_, d, w, run = summed.get(key, (0, 0, 0, [0] * 17, [0] * 17))
        summed[key] = (
            c + r["completed"], re_ + r["retried"], d + r["dead"],
            [a + b for a, b in zip(w, r["wait_hist"], strict=True)],
            [a + b for a, b in zip(run, r["run_hist"], strict=True)],
        )  # fmt: skip
    return summed


async def rollup(conn: asyncpg.Connection | asyncpg.Pool, schema: str = "aioq") -> Rollup:
    rows = await conn.fetch(f"SELECT * FROM {schema}.stats_rollup")
    columns = ("completed", "retried", "dead", "wait_hist", "run_hist")
    return {(r["minute"], r["queue"], r["task"]): tuple(r[c] for c in columns) for r in rows}


async def test_workers_writing_at_once_add_up_in_the_rollup(dsn: str) -> None:
    keys = [(f"q{i % 3}", f"t{i}") for i in range(12)]
    async with asyncpg.create_pool(dsn, min_size=4, max_size=4) as pool:

        async def worker(n: int) -> None:
            # Each worker meets the (queue, task) rows in its own order: a write that locked
            # them in that order would deadlock with another's.
            order = keys if n % 2 else keys[::-1]
            for round_ in range(15):
                recorder = StatsRecorder()
                for i, (queue, task) in enumerate(order):
                    if (i + round_ + n) % 4:
                        kind = (OutcomeKind.SUCCEEDED, OutcomeKind.RETRIED, OutcomeKind.DEAD)[i % 3]
                        recorder.observe(claim(queue, task, waited=i / 10), kind, round_ / 7)
                writer = StatsWriter(
                    schema="aioq", db=pool, recorder=recorder, worker_id=f"w{n}", queues=["q"],
                    concurrency=1,
                )  # fmt: skip
                await writer.run_once()

        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                for n in range(4):
                    tg.start_soon(worker, n)
        expected = await rollup_of_history(pool)
        assert len(expected) >= 12
        assert await rollup(pool) == expected
        minute_rows = await pool.fetchval("SELECT count(*) FROM aioq.stats_history")
        assert minute_rows >= 4 * len(expected) / 2  # four workers' rows summed into one


async def test_the_day_view_reads_the_rollup_and_the_hour_view_the_minutes(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        hist = "'{1,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0}'"
        await conn.execute(
            "INSERT INTO aioq.stats_rollup VALUES"
            f" (now() - interval '20 hours', 'mail', 'mail.send', 7000, 0, 0, {hist}, {hist});"
            "INSERT INTO aioq.stats_history VALUES"
            f" (now(), 'w', 'mail', 'mail.send', 3, 0, 0, {hist}, {hist})"
        )
    finally:
        await conn.close()

    def pages() -> tuple[str, str]:
        with TestClient(aioq.web.app(dsn=dsn)) as client:
            return client.get("/throughput?range=day").text, client.get("/throughput").text

    day, hour = await anyio.to_thread.run_sync(pages)
    assert "7,000" in day
    assert "7,000" not in hour


async def test_the_upgrade_rolls_up_the_history_recorded_before_it(dsn: str) -> None:
    from aioq.migrate import migrations, schema_sql
    from aioq.sql.schema import RECORD_MIGRATION

    schema = "upgraded"
    found = migrations(schema)
    before = next(i for i, m in enumerate(found) if "stats_rollup (" in m.sql)
    conn = await asyncpg.connect(dsn)
    try:
        text = schema_sql(schema)
        await conn.execute(text[: text.index("-- aioq:migration 1\n")])  # the prologue
        for migration in found[:before]:
            await conn.execute(migration.sql)
            await RECORD_MIGRATION.run(conn, schema, migration.version)
        await conn.execute(
            f"INSERT INTO {schema}.stats_history"
            " SELECT now() - make_interval(mins => m), 'w' || w, 'q' || (m % 2), 't' || (m % 3),"
            "        m + w, m % 5, w,"
            "        array_fill(m % 7 + w, ARRAY[17]), array_fill(m % 4, ARRAY[17])"
            " FROM generate_series(0, 179) AS m, generate_series(1, 3) AS w"
        )
        assert await aioq.install(conn, schema=schema) == [m.version for m in found[before:]]
        expected = await rollup_of_history(conn, schema)
        assert len(expected) >= 6 * 6  # six or seven half hours, six (queue, task) pairs
        assert await rollup(conn, schema) == expected
    finally:
        await conn.close()
