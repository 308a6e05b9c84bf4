"""Poison jobs: whatever escapes the code that runs one job fails that job, never the worker
(docs/architecture.md, "Poison jobs").

Real workers on a real PostgreSQL; each fault is injected the way an application or a row
brings it: a registry whose lookup raises, stored arguments that do not decode, a middleware
and tasks that raise odd BaseExceptions or cancel their own asyncio task, a task whose
``retry_on`` breaks the judging of its failure, an outcome the database refuses to store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import asyncpg
import pytest
from waits import HANG_GUARD, eventually, until_sql

import aioq

pytestmark = pytest.mark.anyio

INSTANT = aioq.Backoff(base=0.05, max=0.05, jitter=0)


class Odd(BaseException):
    """Neither an Exception nor a cancellation: what odd code raises."""


class Fragile(aioq.Registry):
    """A registry whose lookup of some names raises (a broken plugin registry, an import with
    side effects that calls sys.exit)."""

    def get(self, name: str) -> aioq.Task[..., Any] | None:
        if name == "resolve.raises":
            raise LookupError("the registry's index is corrupt")
        if name == "resolve.exits":
            raise SystemExit(3)
        return super().get(name)


class _Breaks(type):
    def __instancecheck__(cls, instance: object) -> bool:
        raise RuntimeError("retry_on's isinstance broke")


class Unjudgeable(Exception, metaclass=_Breaks):
    """An exception type whose isinstance check raises: judging a failure against it fails."""


async def raw_job(
    conn: asyncpg.Connection, task: str, *, args: str = "{}", max_attempts: int = 2
) -> int:
    """A job inserted with raw SQL, as another application (or a bad row) would."""
    return int(
        await conn.fetchval(
            "INSERT INTO aioq.jobs (task, args, max_attempts) VALUES ($1, $2::jsonb, $3)"
            " RETURNING id",
            task,
            args,
            max_attempts,
        )
    )


async def serving(worker: aioq.Worker, ended: anyio.Event) -> None:
    """Run a worker; note when its run ended, by itself or not."""
    try:
        await worker.run()
    finally:
        ended.set()


async def test_whatever_escapes_a_step_of_running_a_job_fails_that_job_and_the_worker_goes_on(
    dsn: str, conn: asyncpg.Connection
) -> None:
    registry = Fragile()
    done: list[int] = []

    @registry.task(name="fine")
    async def fine(i: int) -> None:
        done.append(i)

    @registry.task(name="mw.odd", max_attempts=1)
    async def mw_odd() -> None: ...

    @registry.task(name="task.interrupt", max_attempts=1)
    async def interrupt() -> None:
        raise KeyboardInterrupt

    @registry.task(name="task.odd", max_attempts=1)
    def sync_odd() -> None:
        raise Odd("a BaseException from a thread")

    @registry.task(name="task.cancels_itself", max_attempts=2, retry=INSTANT)
    async def cancels_itself() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        await asyncio.sleep(3600)

    @registry.task(name="judge.raises", max_attempts=2, retry=INSTANT, retry_on=Unjudgeable)
    async def unjudgeable() -> None:
        raise ValueError("a plain failure")

    @registry.task(name="outcome.refused")
    async def snoozes() -> None:
        raise aioq.Retry(delay=0)  # max_attempts + 1 overflows integer: the server refuses

    async def middleware(
        job: aioq.JobContext, call_next: Callable[[], Awaitable[object]]
    ) -> object:
        if job.task == "mw.odd":
            raise Odd("from a middleware")
        return await call_next()

    await fine.defer_many(conn, [{"i": i} for i in range(5)])
    poison = {
        "resolve.raises": await raw_job(conn, "resolve.raises"),
        "resolve.exits": await raw_job(conn, "resolve.exits"),
        "decode": await raw_job(conn, "fine", args="[1, 2]", max_attempts=1),
        "mw.odd": await mw_odd.defer(conn),
        "task.interrupt": await interrupt.defer(conn),
        "task.odd": await sync_odd.defer(conn),
        "task.cancels_itself": await cancels_itself.defer(conn),
        "judge.raises": await unjudgeable.defer(conn),
        "outcome.refused": await snoozes.options(max_attempts=2**31 - 1).defer(conn),
    }
    await fine.defer_many(conn, [{"i": i} for i in range(5, 10)])
    worker = aioq.Worker(
        dsn=dsn, registry=registry, middleware=[middleware], concurrency=2, poll_interval=0.05
    )
    ended = anyio.Event()
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(serving, worker, ended)
            await until_sql(
                conn,
                "SELECT count(*) = $1 FROM aioq.jobs WHERE id = ANY($2) AND status = 'dead'",
                len(poison),
                list(poison.values()),
            )
            await until_sql(conn, "SELECT count(*) = $1 FROM aioq.jobs", len(poison))
            # The worker goes on: it runs what comes next.
            await fine.defer(conn, i=10)
            await eventually(lambda: 10 in done, "the job deferred last")
            assert not ended.is_set()
            worker.stop()
    assert sorted(done) == list(range(11))
    rows = {
        r["id"]: r
        for r in await conn.fetch(
            "SELECT id, status, attempts, max_attempts, last_error FROM aioq.jobs"
        )
    }
    errors = {name: rows[job_id]["last_error"] for name, job_id in poison.items()}
    first = {name: error.splitlines()[0] for name, error in errors.items()}
    assert first["resolve.raises"] == (
        "LookupError: the registry's index is corrupt (raised while resolving its task)"
    )
    assert first["resolve.exits"] == "SystemExit: 3 (raised while resolving its task)"
    assert first["decode"].startswith("PayloadError: cannot call 'fine' with its stored arguments")
    assert first["mw.odd"] == "Odd: from a middleware"
    assert first["task.interrupt"] == "KeyboardInterrupt: "
    assert first["task.odd"] == "Odd: a BaseException from a thread"
    assert first["task.cancels_itself"] == (
        "RuntimeError: the task cancelled its own asyncio task (asyncio.current_task().cancel());"
        " a job ends early by returning, raising, or aioq.Retry / aioq.Fail"
    )
    assert first["judge.raises"] == (
        "RuntimeError: retry_on's isinstance broke (raised while judging its outcome)"
    )
    assert first["outcome.refused"].startswith(
        "OutcomeRefused: the database refused to record this attempt's outcome (snoozed):"
        " NumericValueOutOfRangeError: integer out of range"
    )
    # Every attempt counted: a poison job ends dead, never given back for ever.
    attempts = {name: rows[job_id]["attempts"] for name, job_id in poison.items()}
    assert attempts == {
        "resolve.raises": 2,
        "resolve.exits": 2,
        "decode": 1,
        "mw.odd": 1,
        "task.interrupt": 1,
        "task.odd": 1,
        "task.cancels_itself": 2,
        "judge.raises": 2,
        "outcome.refused": 1,
    }


async def test_a_task_that_cancels_its_own_asyncio_task_fails_its_job_on_each_of_three_workers(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    """Three workers with 1 s leases; the job that cancels its own task fails an attempt on
    whichever worker claims it and ends dead; a middleware doing the same, and a task that does
    it as its timeout cancels it (a timeout, then: ours wins), fail their jobs likewise. Every
    worker goes on serving, also after one of them is hard-cancelled."""
    done: list[int] = []

    @registry.task(name="fine", lease=1)
    async def fine(i: int) -> None:
        done.append(i)

    @registry.task(name="cancels_itself", max_attempts=3, retry=INSTANT, lease=1)
    async def cancels_itself() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        await asyncio.sleep(3600)

    @registry.task(name="cancels_unawaited", max_attempts=3, retry=INSTANT, lease=1)
    async def cancels_unawaited() -> str:
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        return "returned before the cancel reached it"  # nothing awaited: it never did

    @registry.task(name="in_middleware", max_attempts=2, retry=INSTANT, lease=1)
    async def in_middleware() -> None: ...

    @registry.task(name="as_timeout", max_attempts=2, retry=INSTANT, lease=1, timeout=0.2)
    async def as_timeout() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            asyncio.current_task().cancel()  # type: ignore[union-attr]
            raise

    async def middleware(
        job: aioq.JobContext, call_next: Callable[[], Awaitable[object]]
    ) -> object:
        if job.task == "in_middleware":
            asyncio.current_task().cancel()  # type: ignore[union-attr]
            await asyncio.sleep(3600)
        return await call_next()

    poison = [
        await cancels_itself.defer(conn),
        await in_middleware.defer(conn),
        await as_timeout.defer(conn),
    ]
    unawaited = await cancels_unawaited.defer(conn)
    await fine.defer_many(conn, [{"i": i} for i in range(6)])
    workers = [
        aioq.Worker(
            dsn=dsn,
            registry=registry,
            middleware=[middleware],
            concurrency=1,
            poll_interval=0.05,
            heartbeat_interval=0.2,
            reaper_interval=0.2,
            shutdown_grace=1.0,
        )
        for _ in range(3)
    ]
    ended = [anyio.Event() for _ in workers]
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            scopes = []
            for worker, event in zip(workers, ended, strict=True):
                scope = anyio.CancelScope()
                scopes.append(scope)

                async def run(w: aioq.Worker = worker, e: anyio.Event = event,
                              s: anyio.CancelScope = scope) -> None:  # fmt: skip
                    with s:
                        await serving(w, e)

                tg.start_soon(run)
            await until_sql(
                conn,
                "SELECT count(*) = 3 FROM aioq.jobs WHERE id = ANY($1) AND status = 'dead'",
                poison,
            )
            await until_sql(conn, "SELECT count(*) = 3 FROM aioq.jobs")
            assert not any(e.is_set() for e in ended)
            scopes[0].cancel()  # a hard cancel of one worker: the others go on
            await ended[0].wait()
            await fine.defer_many(conn, [{"i": i} for i in range(6, 12)])
            await eventually(lambda: len(done) == 12, "the jobs deferred last")
            assert not any(e.is_set() for e in ended[1:])
            for worker in workers[1:]:
                worker.stop()
    assert sorted(done) == list(range(12))
    rows = await conn.fetch(
        "SELECT id, task, attempts, last_error, last_worker FROM aioq.jobs ORDER BY id"
    )
    assert [r["id"] for r in rows] == poison
    first = {r["task"]: r["last_error"].splitlines()[0] for r in rows}
    assert first["cancels_itself"].startswith(
        "RuntimeError: the task cancelled its own asyncio task"
    )
    assert first["in_middleware"].startswith(
        "RuntimeError: the task cancelled its own asyncio task"
    )
    # Its timeout cancelled it too: a timeout (ours), not the task's own cancel.
    assert first["as_timeout"] == "TimeoutError: task 'as_timeout' timed out after 0.2s"
    assert [r["attempts"] for r in rows] == [3, 2, 2]
    # A cancel the task asked for but never awaited does not reach the consumer: it returned.
    assert await conn.fetchval("SELECT count(*) FROM aioq.jobs WHERE id = $1", unawaited) == 0
