"""The dashboard's statements read a bounded number of rows through indexes, whatever the table size.

A jobs table of a quarter of a million rows (enough for the planner to prefer indexes, quick to
make) stands in for ten million: each statement is planned both ways PostgreSQL may run a
prepared statement (custom and generic plan) and must not scan the jobs table sequentially; run
with EXPLAIN ANALYZE, the rows it reads from the jobs table stay within the caps it was given.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import asyncpg
import pytest

from aioq.sql import Named, Statement
from aioq.sql.admin import GET_JOB
from aioq.web import sql as w
from aioq.worker.history import BUCKETS

pytestmark = pytest.mark.anyio

CAP = 500
WINDOW = 1000
PAGE = 50


@pytest.fixture
async def big(conn: asyncpg.Connection) -> asyncpg.Connection:
    await conn.execute(
        """
        INSERT INTO aioq.jobs (queue, task, run_at)
        SELECT 'bulk', 'tasks.t' || (i % 20), now() - interval '1 hour'
        FROM generate_series(1, 200000) AS i;
        INSERT INTO aioq.jobs (queue, task, run_at)
        SELECT 'bulk', 'tasks.later', now() + interval '1 day' FROM generate_series(1, 5000);
        INSERT INTO aioq.jobs (queue, task, status, last_error, attempts)
        SELECT 'bulk', 'tasks.t' || (i % 20), 'dead', 'ValueError: ' || i, 5
        FROM generate_series(1, 20000) AS i;
        INSERT INTO aioq.jobs (queue, task, status, locked_by, locked_at, lease_expires_at)
        SELECT 'bulk', 'tasks.t1', 'running', 'w' || (i % 4), now(), now() + interval '1 minute'
        FROM generate_series(1, 50) AS i;
        INSERT INTO aioq.jobs (queue, task) SELECT 'small', 'tasks.s' FROM generate_series(1, 10);
        INSERT INTO aioq.jobs (queue, task, status)
        SELECT 'bulk', 'tasks.c', 'cancelled' FROM generate_series(1, 3000);
        INSERT INTO aioq.jobs (queue, task, priority, run_at)
        SELECT 'bulk', 'tasks.low', -i, now() - interval '1 day' FROM generate_series(1, 5) AS i;
        ANALYZE aioq.jobs;
        """
    )
    return conn


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += _nodes(child)
    return found


async def _explain(
    conn: asyncpg.Connection, sql: str, args: tuple[Any, ...], mode: str
) -> list[dict[str, Any]]:
    """The plan nodes of ``sql`` (a rendered statement) run as a prepared statement under
    ``plan_cache_mode``."""
    await conn.execute(f"SET plan_cache_mode = {mode}")
    statement = f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}"
    raw = await conn.fetchval(statement, *args)
    await conn.execute("RESET plan_cache_mode")
    return _nodes(json.loads(raw)[0]["Plan"])


def _on_jobs(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in nodes if n.get("Relation Name") == "jobs"]


def _rows_read(nodes: list[dict[str, Any]]) -> int:
    return sum(int(n["Actual Rows"]) * int(n["Actual Loops"]) for n in _on_jobs(nodes))


PAGE_ARGS = {
    "first page": (None, WINDOW, None, None, None, None, PAGE),
    "a later page": (150000, WINDOW, None, None, None, None, PAGE),
    "a rare queue": (None, WINDOW, None, "small", None, None, PAGE),
    "text in last_error": (None, WINDOW, None, None, None, "nowhere", PAGE),
    "a task and status": (None, WINDOW, "pending", None, "tasks.t3", None, PAGE),
}

CASES: dict[str, tuple[str, tuple[Any, ...], int]] = {
    "per-queue pending": (w.DASH_PENDING.text("aioq"), (200, CAP, 50), 2 * CAP + 10 + 2 * 50),
    "states": (w.DASH_STATES.text("aioq"), (CAP,), 4 * CAP),
    "workers": (w.DASH_WORKERS.text("aioq"), (CAP, 200), CAP),
    **{f"page: {k}": (w.DASH_PAGE.text("aioq"), v, WINDOW) for k, v in PAGE_ARGS.items()},
    "dead page": (
        w.DASH_DEAD_PAGE.text("aioq"),
        (None, WINDOW, "dead", "bulk", None, "Error", PAGE),
        WINDOW,
    ),
    "dead page, later": (
        w.DASH_DEAD_PAGE.text("aioq"),
        (5000, WINDOW, "dead", None, None, None, PAGE),
        WINDOW,
    ),
    "cancelled page": (
        w.DASH_CANCELLED_PAGE.text("aioq"),
        (None, WINDOW, "cancelled", None, None, None, PAGE),
        WINDOW,
    ),
    "one job": (GET_JOB.text("aioq"), (123456,), 1),
    "unknown tasks": (w.DASH_UNKNOWN_TASKS.text("aioq"), (CAP,), CAP),
}


async def test_dashboard_statements_use_indexes_and_read_a_bounded_number_of_rows(
    big: asyncpg.Connection,
) -> None:
    assert await big.fetchval("SELECT count(*) FROM aioq.jobs") > 228_000
    for mode in ("force_custom_plan", "force_generic_plan"):
        for name, (sql, args, bound) in CASES.items():
            nodes = await _explain(big, sql, args, mode)
            scans = {n["Node Type"] for n in _on_jobs(nodes)}
            assert scans, (mode, name)
            assert "Seq Scan" not in scans, (mode, name, scans)
            assert _rows_read(nodes) <= bound, (mode, name, _rows_read(nodes), bound)
    await _the_bounded_statements_still_count_right(big)


async def _the_bounded_statements_still_count_right(big: asyncpg.Connection) -> None:
    rows = {r.queue: r for r in await w.DASH_PENDING.rows(big, "aioq", 200, CAP, 50)}
    assert set(rows) == {"bulk", "small"}
    assert (rows["small"].ready, rows["small"].sampled) == (10, 10)
    assert rows["bulk"].sampled == CAP  # stopped at the cap: a lower bound
    # The oldest ready job has a low priority, far behind the cap in claim order: still found.
    assert 86_000 < rows["bulk"].oldest_ready_age < 87_000
    counts = {(r.queue, r.state): r.n for r in await w.DASH_STATES.rows(big, "aioq", CAP)}
    assert counts == {("bulk", "running"): 50, ("bulk", "dead"): CAP, ("bulk", "cancelled"): CAP}


# Each statement of the dashboard, with the type of its rows.
ROW_TYPES: dict[Statement[Any] | Named[Any, Any], type] = {
    w.DASH_PENDING: w.PendingRow,
    w.DASH_STATES: w.StateRow,
    w.DASH_WORKERS: w.WorkerSeen,
    w.DASH_PAGE: w.PageRow,
    w.DASH_DEAD_PAGE: w.PageRow,
    w.DASH_CANCELLED_PAGE: w.PageRow,
    w.HISTORY_TOTALS: w.TotalsRow,
    w.ROLLUP_TOTALS: w.TotalsRow,
    w.HISTORY_SERIES: w.SeriesRow,
    w.ROLLUP_SERIES: w.SeriesRow,
    w.DASH_UNKNOWN_TASKS: w.UnknownRow,
}


async def test_each_row_type_has_its_statements_columns_in_order(conn: asyncpg.Connection) -> None:
    declared = {v for k, v in vars(w).items() if k.isupper() and isinstance(v, Statement | Named)}
    assert declared - set(ROW_TYPES) == {w.SET_STATEMENT_TIMEOUT}  # the one without rows
    for statement, row_type in ROW_TYPES.items():
        prepared = await conn.prepare(statement.text("aioq"))
        names = [a.name for a in prepared.get_attributes()]
        assert names == [f.name for f in dataclasses.fields(row_type)], statement


def test_the_history_sums_every_bucket_of_the_histograms() -> None:
    assert len(BUCKETS) + 1 == w.HIST_WIDTH
    for statement in (w.HISTORY_TOTALS, w.ROLLUP_TOTALS):
        assert f"wait_hist[{len(BUCKETS) + 1}]" in statement.text("aioq")
        assert f"wait_hist[{len(BUCKETS) + 2}]" not in statement.text("aioq")
