"""The worker's shape: a config object, services from one list with test signals, runs again."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import asyncpg
import pytest

import aioq
from aioq.worker.completer import Completer
from aioq.worker.lease import Heartbeat, Reaper
from aioq.worker.monitor import LoopLag
from aioq.worker.notifier import Listener
from aioq.worker.producer import Producer
from aioq.worker.service import Service

pytestmark = pytest.mark.anyio

MakeWorker = Callable[..., aioq.Worker]
HANG_GUARD = 30.0


async def test_a_worker_takes_a_worker_config(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    ran: list[int] = []

    @registry.task(name="t.one")
    async def one() -> None:
        ran.append(aioq.current_job().id)

    config = aioq.WorkerConfig(queues=("default",), concurrency=3, poll_interval=0.2)
    worker = aioq.Worker(dsn=dsn, registry=registry, config=config, shutdown_grace=1.0)
    assert worker.config.concurrency == 3
    assert worker.config.shutdown_grace == 1.0  # keywords override the config's fields
    assert worker.config.poll_interval == 0.2
    job_id = await one.defer(conn)
    with anyio.fail_after(HANG_GUARD):
        await worker.run_until_idle()
    assert ran == [job_id]
    with pytest.raises(TypeError):
        aioq.Worker(dsn=dsn, registry=registry, config=config, no_such_option=1)


async def test_run_until_idle_runs_again_and_again_on_one_worker(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: MakeWorker
) -> None:
    ran: list[int] = []

    @registry.task(name="t.count")
    async def count(n: int) -> None:
        ran.append(n)

    worker = make_worker()
    for round_ in range(3):
        await count.defer_many(conn, [{"n": round_ * 10 + i} for i in range(5)])
        with anyio.fail_after(HANG_GUARD):
            await worker.run_until_idle()
        assert sorted(ran) == sorted(r * 10 + i for r in range(round_ + 1) for i in range(5))
        assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
    with anyio.fail_after(HANG_GUARD):
        await worker.run_until_idle()  # nothing to do: returns at once


async def test_a_worker_never_runs_twice_at_once(make_worker: MakeWorker) -> None:
    worker = make_worker()
    async with worker:
        with pytest.raises(aioq.errors.ConfigError, match="already running"):
            await worker.run()


async def test_services_are_built_from_one_list_and_signal_each_pass(
    make_worker: MakeWorker,
) -> None:
    worker = make_worker(reaper_interval=0.05, heartbeat_interval=0.05)
    async with worker:
        kinds = [type(s) for s in worker.current.services]
        assert kinds[0] is Completer
        assert kinds[-1] is Producer
        assert {Listener, Heartbeat, Reaper, LoopLag} <= set(kinds)
        with anyio.fail_after(HANG_GUARD):
            reaper = worker.service(Reaper)
            passes = reaper.passed.count
            await reaper.passed.wait()
            await reaper.passed.wait()
            assert reaper.passed.count >= passes + 2
            await worker.service(Heartbeat).passed.wait()
        with pytest.raises(LookupError):
            worker.service(type("Missing", (Service,), {}))


async def test_a_failing_pass_is_retried_with_backoff_and_never_ends_the_loop() -> None:
    class Flaky(Service):
        name = "flaky"

        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def interval(self) -> float:
            return 0.01

        async def run_once(self) -> int:
            self.calls += 1
            if self.calls <= 2:
                raise RuntimeError("boom")
            return self.calls

    flaky = Flaky()
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            await tg.start(flaky.run)
            await flaky.passed.wait()
            tg.cancel_scope.cancel()
    assert flaky.calls == 3
    assert flaky.failures.count == 0  # reset by the pass that succeeded
