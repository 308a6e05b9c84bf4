"""Durations and times PostgreSQL would refuse are refused before any SQL, naming the option.

Each of these values used to pass validation and abort the caller's transaction at defer
(interval or timestamp out of range, the lease CHECK), or was silently mangled by the driver.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest
from procs import aioq_cli, assert_one_line_error

import aioq
from aioq.options import MAX_DURATION, MIN_LEASE

pytestmark = pytest.mark.anyio

EAST = timezone(timedelta(hours=5))
WEST = timezone(timedelta(hours=-5))

BAD_OPTIONS: list[dict[str, Any]] = [
    {"delay": math.nan},
    {"delay": math.inf},
    {"delay": -math.inf},
    {"delay": 1e13},
    {"delay": MAX_DURATION * 1.01},
    {"delay": timedelta.max},
    {"delay": timedelta(days=10**8)},
    {"lease": math.inf},
    {"lease": math.nan},
    {"lease": 1e300},
    {"lease": 1e-9},
    {"lease": MIN_LEASE / 2},
    {"lease": 1e12},
    {"run_at": datetime.max.replace(tzinfo=WEST)},  # past year 9999 in UTC
    {"run_at": datetime.min.replace(tzinfo=EAST)},  # before year 1 in UTC
    {"run_at": "2031-01-01T00:00:00Z"},
]


@pytest.fixture
def work(registry: aioq.Registry) -> aioq.Task[[int], None]:
    @registry.task(name="t.work")
    async def work(n: int) -> None: ...

    return work


def test_an_int_past_floats_range_is_refused(work: aioq.Task[[int], None]) -> None:
    for field in ("delay", "lease"):  # OverflowError from float() before
        with pytest.raises(
            aioq.errors.OptionError, match=f"option {field}: .*an integer past float's range"
        ):
            work.options(**{field: 10**400})  # type: ignore[arg-type]


@pytest.mark.parametrize("options", BAD_OPTIONS, ids=repr)
async def test_bad_duration_or_time_is_refused_and_the_transaction_stays_usable(
    conn: asyncpg.Connection, work: aioq.Task[[int], None], options: dict[str, Any]
) -> None:
    [(field, _)] = options.items()
    async with conn.transaction():
        await conn.execute("CREATE TEMP TABLE mine (n int)")
        with pytest.raises(aioq.errors.DeferError) as info:
            await work.options(**options).defer(conn, n=1)
        with pytest.raises(aioq.errors.DeferError):
            await work.options(**options).defer_many(conn, [{"n": 1}, {"n": 2}])
        # The caller's transaction goes on: its own statements still run and commit.
        await conn.execute("INSERT INTO mine VALUES (1)")
    assert await conn.fetchval("SELECT count(*) FROM mine") == 1
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
    error = info.value
    assert isinstance(error, aioq.errors.OptionError)
    assert isinstance(error, aioq.errors.ConfigError)  # what options(...) raised before
    assert (error.task_name, error.field) == ("t.work", field)
    assert str(error).startswith(f"cannot defer 't.work': option {field}: ")


@pytest.mark.parametrize(
    "options",
    [{"lease": math.inf}, {"lease": 1e-9}, {"lease": math.nan}, {"lease": 1e300}],
    ids=repr,
)
def test_task_decorator_refuses_a_bad_lease(
    registry: aioq.Registry, options: dict[str, Any]
) -> None:
    with pytest.raises(aioq.errors.ConfigError, match=r"^lease: "):

        @registry.task(**options)
        async def work() -> None: ...

    assert len(registry) == 0


@pytest.mark.parametrize(
    "backoff",
    [{"base": math.nan}, {"max": math.inf}, {"base": 1e300, "max": 1e300}, {"factor": math.nan}],
    ids=repr,
)
def test_backoff_refuses_delays_the_completer_could_not_write(backoff: dict[str, Any]) -> None:
    with pytest.raises(aioq.errors.ConfigError, match=next(iter(backoff))):
        aioq.Backoff(**backoff)


async def test_edge_values_inside_the_ranges_are_stored(
    conn: asyncpg.Connection, work: aioq.Task[[int], None]
) -> None:
    lease_id = await work.options(lease=MIN_LEASE, delay=MAX_DURATION).defer(conn, n=1)
    late, early = datetime(9999, 12, 31, tzinfo=UTC), datetime(1, 1, 2, tzinfo=UTC)
    late_id = await work.options(run_at=late).defer(conn, n=2)
    early_id = await work.options(run_at=early).defer(conn, n=3)
    rows = {
        row["id"]: row
        for row in await conn.fetch(
            "SELECT id, extract(epoch FROM lease)::float8 AS lease, run_at,"
            " extract(epoch FROM run_at - created_at)::float8 AS delay FROM aioq.jobs"
        )
    }
    assert rows[lease_id]["lease"] == MIN_LEASE
    assert rows[lease_id]["delay"] == pytest.approx(MAX_DURATION, abs=1)
    assert rows[late_id]["run_at"] == late
    assert rows[early_id]["run_at"] == early


def test_cli_defer_refuses_a_delay_out_of_range(dsn: str) -> None:
    result = aioq_cli(dsn, "defer", "t.work", "--delay", "99999999999d")
    assert_one_line_error(result, "delay", "seconds")
    ok = aioq_cli(dsn, "defer", "t.work", "--delay", "3d")
    assert ok.returncode == 0, ok
    listed = aioq_cli(dsn, "jobs", "list", "--json")
    assert [job["id"] for job in json.loads(listed.stdout)] == [int(ok.stdout)]


@pytest.mark.parametrize("older_than", [math.inf, math.nan, 1e12, -1.0], ids=repr)
async def test_purge_dead_refuses_an_age_out_of_range_before_any_sql(
    conn: asyncpg.Connection, older_than: float
) -> None:
    async with conn.transaction():
        with pytest.raises(aioq.errors.ConfigError, match=r"^older_than: "):
            await aioq.admin.purge_dead(conn, older_than=older_than)
        assert await conn.fetchval("SELECT 1") == 1  # the transaction is still usable


@pytest.mark.parametrize("field", ["archive_retention", "dead_retention", "workflow_retention"])
@pytest.mark.parametrize("value", [math.inf, 1e12], ids=repr)
def test_retention_out_of_range_is_refused(field: str, value: float) -> None:
    with pytest.raises(aioq.errors.ConfigError, match=f"^{field}: "):
        aioq.WorkerConfig(**{field: value})  # type: ignore[arg-type]


INTERVALS = (
    "poll_interval",
    "heartbeat_interval",
    "reaper_interval",
    "prune_interval",
    "vacuum_interval",
    "stats_interval",
    "stats_retention",
    "limits_refresh",
    "command_timeout",
    "lag_threshold",
)


@pytest.mark.parametrize("field", [*INTERVALS, "shutdown_grace"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1.0, 1e12, "5", True], ids=repr)
def test_worker_durations_out_of_range_are_refused(field: str, value: object) -> None:
    with pytest.raises(aioq.errors.ConfigError, match=f"^{field}: ") as refused:
        aioq.WorkerConfig(**{field: value})  # type: ignore[arg-type]
    assert refused.value.field == field


@pytest.mark.parametrize("field", INTERVALS)
def test_worker_intervals_must_not_be_zero(field: str) -> None:
    with pytest.raises(aioq.errors.ConfigError, match=f"^{field}: "):
        aioq.WorkerConfig(**{field: 0})  # type: ignore[arg-type]
    aioq.WorkerConfig(**{field: 0.001})  # type: ignore[arg-type]


def test_worker_edge_durations_are_accepted() -> None:
    aioq.WorkerConfig(
        shutdown_grace=0, poll_interval=MAX_DURATION, command_timeout=None, lag_threshold=None
    )


@pytest.mark.parametrize(
    "field",
    [
        "concurrency",
        "reaper_batch",
        "claim_batch",
        "completion_batch",
        "prune_batch",
        "vacuum_threshold",
    ],
)
@pytest.mark.parametrize("value", [True, 1.5, "2", 0], ids=repr)
def test_worker_counts_are_integers(field: str, value: object) -> None:
    # True is an int to isinstance: it used to be taken as a count of 1.
    with pytest.raises(
        aioq.errors.ConfigError, match=f"^{field}: (must be|must be None or) an integer >= 1"
    ):
        aioq.WorkerConfig(**{field: value})  # type: ignore[arg-type]
    aioq.WorkerConfig(**{field: 2})  # type: ignore[arg-type]


def test_cli_purge_refuses_an_age_out_of_range(dsn: str) -> None:
    result = aioq_cli(dsn, "jobs", "purge", "--dead", "--older-than", "99999999999d")
    assert_one_line_error(result, "older_than", "seconds")


@pytest.mark.parametrize(
    "options",
    [{"priority": 1.5}, {"priority": True}, {"max_attempts": 2.5}, {"max_attempts": "3"}],
    ids=repr,
)
def test_integer_options_are_integers(
    work: aioq.Task[[int], None], options: dict[str, Any]
) -> None:
    # The driver used to store priority=1.5 as 1 and max_attempts=2.5 as 2, silently.
    with pytest.raises(aioq.errors.OptionError, match=next(iter(options))):
        work.options(**options)
