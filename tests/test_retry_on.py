"""Retry by exception type: retry_on and no_retry_on on a task."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

import aioq
from aioq.errors import ConfigError
from aioq.job import Claim, OutcomeKind
from aioq.worker.claims import Running
from aioq.worker.consumer import Attempt, judge

pytestmark = pytest.mark.anyio
MakeWorker = Callable[..., aioq.Worker]


class Flaky(Exception):
    """A failure worth another try."""


class Broken(Flaky):
    """A subclass of a retried failure that is not."""


async def outcome(conn: asyncpg.Connection, job_id: int) -> tuple[str, int, str]:
    row = await conn.fetchrow(
        "SELECT status, attempts, last_error FROM aioq.jobs WHERE id = $1", job_id
    )
    assert row is not None
    return row["status"], row["attempts"], row["last_error"].split(":")[0]


async def test_retry_on_retries_only_those_exceptions(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="fetch", retry_on=(Flaky, ConnectionError), no_retry_on=Broken)
    async def fetch(raise_: str) -> None:
        raise {"flaky": Flaky, "conn": ConnectionResetError, "value": ValueError,
               "broken": Broken}[raise_]("no")  # fmt: skip

    ids = {name: await fetch.defer(conn, name) for name in ("flaky", "conn", "value", "broken")}
    await make_worker().run_until_idle()
    # Retried: pending again (after the backoff), one attempt spent.
    assert await outcome(conn, ids["flaky"]) == ("pending", 1, "Flaky")
    assert await outcome(conn, ids["conn"]) == ("pending", 1, "ConnectionResetError")
    # Not among retry_on, or among no_retry_on: dead at the first failure.
    assert await outcome(conn, ids["value"]) == ("dead", 1, "ValueError")
    assert await outcome(conn, ids["broken"]) == ("dead", 1, "Broken")


async def test_no_retry_on_alone_retries_everything_else_and_retry_and_fail_still_work(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="parse", no_retry_on=ValueError, retry_on=None)
    def parse(raise_: str) -> None:  # a sync task: the same rules
        if raise_ == "retry":
            raise aioq.Retry(delay=3600)
        raise {"value": ValueError, "key": KeyError, "fail": aioq.Fail}[raise_]("no")

    @registry.task(name="strict", retry_on=ConnectionError)
    async def strict() -> None:
        raise aioq.Retry(delay=3600)  # a snooze is not a failure: retry_on has no say

    ids = {name: await parse.defer(conn, name) for name in ("value", "key", "fail", "retry")}
    snoozed = await strict.defer(conn)
    await make_worker().run_until_idle()
    assert await outcome(conn, ids["value"]) == ("dead", 1, "ValueError")
    assert await outcome(conn, ids["key"]) == ("pending", 1, "KeyError")
    assert await outcome(conn, ids["fail"]) == ("dead", 1, "Fail")
    for job_id in (ids["retry"], snoozed):
        row = await conn.fetchrow("SELECT status, snoozes FROM aioq.jobs WHERE id = $1", job_id)
        assert tuple(row) == ("pending", 1)


async def test_a_timeout_counts_as_a_timeout_error(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    @registry.task(name="slow", timeout=0.05, retry_on=ConnectionError)
    async def slow() -> None:
        await aioq_sleep()

    @registry.task(name="slow_ok", timeout=0.05, retry_on=TimeoutError)
    async def slow_ok() -> None:
        await aioq_sleep()

    dead, retried = await slow.defer(conn), await slow_ok.defer(conn)
    await make_worker().run_until_idle()
    assert await outcome(conn, dead) == ("dead", 1, "TimeoutError")
    assert await outcome(conn, retried) == ("pending", 1, "TimeoutError")


async def aioq_sleep() -> None:
    import anyio

    await anyio.sleep(30)


def test_judge_decides_without_io(registry: aioq.Registry) -> None:
    @registry.task(name="t", retry_on=OSError, max_attempts=3)
    async def t() -> None: ...

    claim = Claim(1, 1, "default", "t", "{}", 0, 1, 3, 30.0, 0.0)
    running = Running(claim)

    def kind(error: BaseException) -> Any:
        decided = judge(claim, t, running, Attempt(time.monotonic(), error=error))
        assert decided is not None
        return decided.kind

    assert kind(OSError()) is OutcomeKind.RETRIED
    assert kind(FileNotFoundError()) is OutcomeKind.RETRIED  # a subclass counts
    assert kind(RuntimeError()) is OutcomeKind.DEAD


def test_bad_values_are_refused_at_registration(registry: aioq.Registry) -> None:
    for bad in ((), "ValueError", (ValueError, "x"), 3, (int,)):
        with pytest.raises(ConfigError, match="retry_on: must be an exception class"):
            registry.task(name="x", retry_on=bad)(lambda: None)  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="no_retry_on: must be an exception class"):
        registry.task(name="y", no_retry_on=[ValueError])(lambda: None)  # type: ignore[call-overload]
    assert "x" not in registry
    assert "y" not in registry
