"""Jobs whose task a worker does not know (docs/architecture.md, "Unknown tasks"): a rolling
deploy where the code that defers a task runs before the workers that run it."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import asyncpg
import pytest
from procs import aioq_cli
from waits import HANG_GUARD, eventually, until_sql

import aioq
from aioq import hooks
from aioq.job import Claim
from aioq.worker.producer import Producer

pytestmark = pytest.mark.anyio

JOBS = 20


class Claimed(hooks.Observer):
    """Every claim each worker made: (worker id, job id, claim number)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []

    def claimed(self, worker_id: str, claims: Sequence[Claim], start_ns: int, end_ns: int) -> None:
        self.seen += [(worker_id, c.id, c.number) for c in claims]


def fleet(dsn: str, registry: aioq.Registry, worker_id: str, **options: object) -> aioq.Worker:
    return aioq.Worker(
        dsn=dsn,
        registry=registry,
        worker_id=worker_id,
        poll_interval=0.05,
        heartbeat_interval=0.2,
        reaper_interval=0.2,
        shutdown_grace=0.5,
        **options,  # type: ignore[arg-type]
    )


async def test_a_deploy_old_workers_hand_new_tasks_on_unspent_and_a_new_one_runs_them(
    dsn: str, conn: asyncpg.Connection
) -> None:
    """Two old workers (that do not know ``new.task``) and, later, a new one that does; 1 s
    leases; one old worker is hard-cancelled meanwhile. Each job of the new task is claimed by
    an old worker at most once per old worker, never spends an attempt, is visible as waiting,
    and runs exactly once on the new worker as soon as it comes; the old workers go on with
    the tasks they know."""
    old, new = aioq.Registry(), aioq.Registry()
    ran: list[tuple[str, int, int]] = []  # (worker, job, attempt)

    for registry in (old, new):

        @registry.task(name="common", lease=1)
        async def common(i: int) -> None:
            job = aioq.current_job()
            ran.append((job.worker_id, job.id, job.attempt))

    @new.task(name="new.task", lease=1)
    async def new_task(i: int) -> None:
        job = aioq.current_job()
        ran.append((job.worker_id, job.id, job.attempt))

    # The web tier, deployed first, defers the new task (through the new code).
    ids = await new_task.defer_many(conn, [{"i": i} for i in range(JOBS)])
    common_ids = await old.get("common").defer_many(conn, [{"i": i} for i in range(5)])  # type: ignore[union-attr]
    observer = Claimed()
    hooks.install(observer)
    try:
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                olds = [fleet(dsn, old, f"old-{n}") for n in range(2)]
                scopes = [anyio.CancelScope(), anyio.CancelScope()]

                async def serve(worker: aioq.Worker, scope: anyio.CancelScope) -> None:
                    with scope:
                        await worker.run()

                for worker, scope in zip(olds, scopes, strict=True):
                    tg.start_soon(serve, worker, scope)
                await until_sql(
                    conn,
                    "SELECT count(*) = $2 FROM aioq.jobs WHERE id = ANY($1) AND status = 'pending'"
                    " AND attempts = 0 AND unknown_since IS NOT NULL",
                    ids,
                    JOBS,
                )
                await eventually(lambda: {j for _, j, _ in ran} >= set(common_ids))
                # Visible: stats, the CLI.
                stats = await aioq.admin.stats(conn)
                [waiting] = stats.unknown_tasks
                assert (waiting.queue, waiting.task, waiting.jobs) == ("default", "new.task", JOBS)
                listed = aioq_cli(dsn, "jobs", "list", "--task", "new.task").stdout
                assert listed.count("pending (waits for a worker that knows its task since") == JOBS
                # The old workers leave them alone now: more passes claim none of them again.
                for worker in olds:
                    producer = worker.service(Producer)
                    for _ in range(5):
                        producer.doorbell.ring()
                        await producer.passed.wait()
                claims = [r[0] for r in await conn.fetch(
                    "SELECT claims FROM aioq.jobs WHERE id = ANY($1)", ids
                )]  # fmt: skip
                assert all(1 <= n <= len(olds) for n in claims), claims
                scopes[0].cancel()  # a hard cancel of one old worker
                # The new worker comes: it takes every one of them at once.
                newer = fleet(dsn, new, "new-0")
                tg.start_soon(serve, newer, anyio.CancelScope())
                await until_sql(conn, "SELECT count(*) = 0 FROM aioq.jobs WHERE id = ANY($1)", ids)
                # The surviving old worker goes on with what it knows.
                later = await old.get("common").defer(conn, i=99)  # type: ignore[union-attr]
                await eventually(lambda: later in {j for _, j, _ in ran})
                olds[1].stop()
                newer.stop()
    finally:
        hooks.uninstall(observer)
    runs = [(w, j, a) for w, j, a in ran if j in ids]
    assert sorted(j for _, j, _ in runs) == sorted(ids)  # each exactly once
    assert {w for w, _, _ in runs} == {"new-0"}
    assert {a for _, _, a in runs} == {1}  # no attempt spent while it waited
    # The claim number moved on every claim (invariant 13): the new worker's claim of each job
    # comes after the old workers'.
    for job_id in ids:
        numbers = [(w, n) for w, j, n in observer.seen if j == job_id]
        assert [n for _, n in numbers] == list(range(1, len(numbers) + 1)), numbers
        assert numbers[-1][0] == "new-0"


async def test_past_its_grace_a_job_no_worker_knows_is_dead_and_it_was_claimed_twice(
    dsn: str, conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    await conn.execute("INSERT INTO aioq.jobs (task) VALUES ('gone.task')")
    worker = fleet(dsn, registry, "old-0", unknown_task_grace=0.5)
    with anyio.fail_after(HANG_GUARD):
        async with worker:
            await until_sql(conn, "SELECT status = 'dead' FROM aioq.jobs")
    row = await conn.fetchrow("SELECT attempts, claims, last_error, unknown_since FROM aioq.jobs")
    # Handed on (marked) by its first claim; its second, once the grace was spent, made it dead.
    assert (row["attempts"], row["claims"]) == (1, 2)
    assert row["last_error"].startswith(
        "UnknownTaskError: no task named 'gone.task' is registered in the workers that claimed"
        " this job, and no worker that knows it took it within unknown_task_grace (0.5s;"
    )
    assert row["unknown_since"] is None
