"""Scenario 7: a role with only the documented grants ("Permissions") runs everything.

The grants are read from the operations guide itself, so the documented set is the tested set.
With them the role defers, runs a real worker process (claims, retries, burial, the reaper, the
archive and its pruning, LISTEN) and the admin commands; every grant in the set is needed by
some operation; the role cannot alter or drop anything; ``aioq schema apply`` run as it fails
with one line saying it needs the owner.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
import statements
from harness import (
    HANG_GUARD,
    RUNS_TABLE,
    STOP_TIMEOUT,
    WorkerProcess,
    db_now,
    fetch,
    role,
    run_counts,
    run_times,
    scaled,
    value,
    wait_for,
    write_tasks,
)
from procs import aioq_cli, assert_one_line_error
from waits import eventually

import aioq
from aioq.job import OutcomeKind
from aioq.migrate import migrations
from aioq.sql.maintenance import PRUNE_ARCHIVE, PRUNE_RESULTS, PRUNE_UNIQUES
from aioq.sql.workflows import PRUNE_WORKFLOWS
from aioq.worker.scheduler import Scheduler

pytestmark = pytest.mark.chaos

GUIDE = Path(__file__).parents[2] / "docs" / "operations-and-cli.md"

TASKS = """
registry = aioq.Registry()
QUICK = aioq.Backoff(base=0.05, max=0.2)


@registry.task(name="app.work")
async def work(n: int) -> None:
    await record("ok")


@registry.task(name="app.flaky", retry=QUICK)
async def flaky(n: int) -> None:
    if aioq.current_job().attempt == 1:
        await record("fail")
        raise RuntimeError("flaky fails its first attempt")
    await record("ok")


@registry.task(name="app.doomed", max_attempts=2, retry=QUICK)
async def doomed(n: int) -> None:
    await record("fail")
    raise RuntimeError(f"doomed {n} always fails")
"""

registry = aioq.Registry()


@registry.task(name="app.work")
async def work(n: int) -> None: ...


@registry.task(name="app.flaky")
async def flaky(n: int) -> None: ...


@registry.task(name="app.doomed", max_attempts=2)
async def doomed(n: int) -> None: ...


async def beat() -> None: ...


def documented_grants() -> list[str]:
    """The GRANT statements of the guide's Permissions section, for a role named ``app``."""
    text = GUIDE.read_text()
    section = text.split("## Permissions", 1)[1]
    block = re.search(r"```sql\n(.*?)```", section, re.DOTALL)
    assert block, "docs/operations-and-cli.md: no sql block under ## Permissions"
    grants = [s.strip() for s in block.group(1).split(";") if s.strip()]
    assert grants
    assert all(g.startswith("GRANT ") and g.endswith(" TO app") for g in grants)
    return grants


@pytest.fixture
def app(admin_dsn: str, dsn: str) -> Iterator[tuple[str, str]]:
    """A login role with exactly the documented grants: (its name, a DSN as it)."""
    with role(admin_dsn, dsn) as (name, app_dsn):
        for grant in documented_grants():
            fetch(dsn, grant.removesuffix(" TO app") + f" TO {name}")
        yield name, app_dsn


def test_least_privileged_role_defers_and_runs_a_worker_process(
    dsn: str, app: tuple[str, str], tmp_path: Path
) -> None:
    _, app_dsn = app
    jobs = scaled(100, 1000)
    fetch(dsn, RUNS_TABLE)
    # Work for the reaper (a claim whose lease expired) and the pruner (an archived row past
    # the 7-day retention), put there by the owner before the worker starts.
    ghost = value(
        dsn,
        "INSERT INTO aioq.jobs (task, args, status, attempts, locked_by, locked_at,"
        " lease_expires_at) VALUES ('app.work', '{\"n\": -1}', 'running', 1, 'ghost',"
        " now() - interval '1 hour', now() - interval '1 minute') RETURNING id",
    )
    fetch(
        dsn,
        "INSERT INTO aioq.archive (id, queue, task, args, priority, attempts, max_attempts,"
        " created_at, started_at, finished_at) VALUES (-1, 'default', 'app.work', '{}', 0, 1, 5,"
        " now() - interval '9 days', now() - interval '9 days', now() - interval '8 days')",
    )
    module = write_tasks(tmp_path, "apptasks", TASKS)
    worker = WorkerProcess(
        f"{module}:registry",
        "--concurrency", "10", "--poll-interval", "0.5", "--keep-completed",
        dsn=app_dsn,
        cwd=tmp_path,
        env={"CHAOS_RECORD_DSN": dsn},
    )  # fmt: skip

    async def defer_all() -> tuple[list[int], int, int]:
        conn = await asyncpg.connect(app_dsn)
        try:
            async with conn.transaction():
                ids = await work.defer_many(conn, [{"n": i} for i in range(jobs)])
                ids.append(await work.options(unique_key="once").defer(conn, n=jobs))
            return ids, await flaky.defer(conn, n=0), await doomed.defer(conn, n=0)
        finally:
            await conn.close()

    started = db_now(dsn)
    with worker:
        worker.wait_listening(dsn)
        work_ids, flaky_id, doomed_id = asyncio.run(defer_all())
        cli = aioq_cli(app_dsn, "defer", "app.work", "--args", '{"n": 0}', timeout=STOP_TIMEOUT)
        assert cli.returncode == 0, cli.stderr
        work_ids += [ghost, int(cli.stdout)]

        def settled() -> bool:
            return (
                len(run_counts(dsn)) == len(work_ids) + 1
                and value(dsn, "SELECT status FROM aioq.jobs WHERE id = $1", doomed_id) == "dead"
            )

        wait_for(settled, "every job to finish or die", on_timeout=worker.log)
        # The admin commands, as the same role: list, stats, replay the dead job.
        listed = aioq_cli(
            app_dsn, "jobs", "list", "--status", "dead", "--json", timeout=STOP_TIMEOUT
        )
        assert [j["id"] for j in json.loads(listed.stdout)] == [doomed_id], listed.stderr
        assert aioq_cli(app_dsn, "stats", timeout=STOP_TIMEOUT).returncode == 0
        retried = aioq_cli(app_dsn, "jobs", "retry", str(doomed_id), timeout=STOP_TIMEOUT)
        assert retried.returncode == 0, retried.stderr
        wait_for(
            lambda: (
                run_counts(dsn, "fail").get(doomed_id) == 4
                and value(dsn, "SELECT status FROM aioq.jobs WHERE id = $1", doomed_id) == "dead"
            ),
            "the replayed job to die again",
            on_timeout=worker.log,
        )
        assert worker.stop() == 0, worker.log()[-3000:]

    ok = run_counts(dsn)
    assert set(ok) == {*work_ids, flaky_id}
    assert set(ok.values()) == {1}
    archived = {r[0] for r in fetch(dsn, "SELECT id FROM aioq.archive")}
    assert archived == {*work_ids, flaky_id}  # -1 was pruned, everything else archived
    assert [tuple(r) for r in fetch(dsn, "SELECT id, status FROM aioq.jobs")] == [
        (doomed_id, "dead")
    ]
    log = worker.log()
    assert "permission denied" not in log
    assert "failed; retrying" not in log  # no background loop hit a database error
    assert "pruner: deleted 1 archived" in log
    rescued = (run_times(dsn)[ghost] - started).total_seconds()
    print(
        f"\nleast privilege: {len(work_ids) + 2} jobs by one worker process as the app role;"
        f" the expired claim ran again {rescued:.2f}s after the worker was started"
    )


def test_every_documented_grant_is_needed(dsn: str, app: tuple[str, str]) -> None:
    """Revoke each privilege in turn: some operation of defer or the worker then fails."""
    name, app_dsn = app
    Op = Callable[[asyncpg.Connection], Awaitable[object]]

    async def claim_one(conn: asyncpg.Connection) -> aioq.job.Claim:
        await work.defer(conn, n=1)
        [claimed] = await statements.claim(conn, ["default"], 1, "w")
        return claimed

    async def defer(conn: asyncpg.Connection) -> object:
        return await work.defer(conn, n=1)

    async def claim(conn: asyncpg.Connection) -> object:
        return await statements.claim(conn, ["default"], 1, "w")

    def complete(archive: bool) -> Op:
        async def run(conn: asyncpg.Connection) -> object:
            claimed = await claim_one(conn)
            return await statements.write(
                conn, "w", [claimed], OutcomeKind.SUCCEEDED, archive=archive
            )

        return run

    async def prune(conn: asyncpg.Connection) -> object:
        return await PRUNE_ARCHIVE.row(conn, "aioq", 0.0, 10)

    def claim_from(queue: str) -> Op:
        async def run(conn: asyncpg.Connection) -> object:
            await work.options(queue=queue).defer(conn, n=1)
            return await statements.claim(conn, [queue], 1, "w")

        return run

    async def set_limit(conn: asyncpg.Connection) -> object:
        return await aioq.admin.set_queue(conn, "limited", max_running=1000)

    ticks = iter(range(1, 10_000))
    start = datetime(2026, 1, 1, tzinfo=UTC)

    async def schedule(conn: asyncpg.Connection) -> object:
        """A schedule seen for the first time, then its next tick."""
        reg = aioq.Registry()
        name = f"app.beat{next(ticks)}"
        aioq.periodic(every=60)(reg.task(name=name)(beat))
        scheduler = Scheduler(schema="aioq", db=conn, schedules=list(reg.schedules.values()))
        await scheduler.run_once(start)
        return await scheduler.run_once(start + timedelta(minutes=1))

    async def keep_result(conn: asyncpg.Connection) -> object:
        claimed = await claim_one(conn)
        return await statements.write(
            conn, "w", [claimed], OutcomeKind.SUCCEEDED, result="1", ttl=0.0
        )

    async def prune_results(conn: asyncpg.Connection) -> object:
        return await PRUNE_RESULTS.row(conn, "aioq", 10)

    async def defer_once(conn: asyncpg.Connection) -> object:
        """A unique_for defer of a new key: the window's gate and the job's id first."""
        return await work.options(unique_key=f"once-{next(ticks)}", unique_for=60).defer(conn, n=1)

    async def prune_uniques(conn: asyncpg.Connection) -> object:
        return await PRUNE_UNIQUES.row(conn, "aioq", 10)

    async def defer_flow(conn: asyncpg.Connection) -> object:
        """A workflow: the run's row and its ids, its steps and their edge."""
        flow = aioq.chain(work.options(queue="flows").call(n=1), work.call(n=2), name="flow")
        return await flow.defer(conn)

    async def finish_step(conn: asyncpg.Connection) -> object:
        """A step's success recorded, its dependent made pending (the fan-in)."""
        run = await defer_flow(conn)
        assert isinstance(run, aioq.workflows.WorkflowRun)
        [claimed] = await statements.claim(conn, ["flows"], 1, "w")
        await statements.write(conn, "w", [claimed], OutcomeKind.SUCCEEDED, result="1", steps=True)
        return await conn.fetchval("SELECT status FROM aioq.jobs WHERE id = $1", run.jobs["work-2"])

    async def prune_runs(conn: asyncpg.Connection) -> object:
        return await PRUNE_WORKFLOWS.row(conn, "aioq", 0.0, 10)

    needed: list[tuple[str, Op]] = [
        ("USAGE ON SCHEMA aioq", defer),
        ("INSERT ON aioq.jobs", defer),
        ("SELECT ON aioq.jobs", claim),
        ("UPDATE ON aioq.jobs", claim),
        ("DELETE ON aioq.jobs", complete(archive=False)),
        ("INSERT ON aioq.archive", complete(archive=True)),
        ("SELECT ON aioq.archive", prune),
        ("UPDATE ON aioq.archive", prune),  # the pruner's FOR UPDATE SKIP LOCKED
        ("DELETE ON aioq.archive", prune),
        # Queue limits: every worker reads which of its queues are limited; a limited queue's
        # claim locks its row; a rate-limited one counts, records and prunes its claims.
        ("SELECT ON aioq.queues", claim_from("default")),
        ("UPDATE ON aioq.queues", claim_from("limited")),
        ("INSERT ON aioq.queues", set_limit),
        ("SELECT ON aioq.queue_claims", claim_from("rated")),
        ("INSERT ON aioq.queue_claims", claim_from("rated")),
        ("UPDATE ON aioq.queue_claims", claim_from("rated")),
        ("DELETE ON aioq.queue_claims", claim_from("rated")),
        # Periodic jobs: read the last ticks, record a new schedule, advance it.
        ("SELECT ON aioq.schedules", schedule),
        ("INSERT ON aioq.schedules", schedule),
        ("UPDATE ON aioq.schedules", schedule),
        ("INSERT ON aioq.results", keep_result),  # tasks with result_ttl
        ("SELECT ON aioq.results", prune_results),
        ("UPDATE ON aioq.results", prune_results),
        ("DELETE ON aioq.results", prune_results),
        # Unique windows: the defer's gate (an upsert that reads the row) and the pruner.
        ("INSERT ON aioq.uniques", defer_once),
        ("SELECT ON aioq.uniques", defer_once),
        ("UPDATE ON aioq.uniques", defer_once),
        ("DELETE ON aioq.uniques", prune_uniques),
        ("USAGE ON SEQUENCE aioq.jobs_id_seq", defer_once),
        # Workflows: the defer, the fan-in, the pruner.
        ("USAGE ON SEQUENCE aioq.jobs_id_seq", defer_flow),
        ("INSERT ON aioq.workflows", defer_flow),
        ("SELECT ON aioq.workflows", defer_flow),
        ("INSERT ON aioq.workflow_steps", defer_flow),
        ("INSERT ON aioq.workflow_deps", defer_flow),
        ("SELECT ON aioq.workflow_steps", finish_step),
        ("UPDATE ON aioq.workflow_steps", finish_step),
        ("SELECT ON aioq.workflow_deps", finish_step),
        ("UPDATE ON aioq.workflows", prune_runs),
        ("DELETE ON aioq.workflows", prune_runs),
        ("DELETE ON aioq.workflow_steps", prune_runs),
        ("DELETE ON aioq.workflow_deps", prune_runs),
    ]

    async def scenario() -> None:
        owner = await asyncpg.connect(dsn)
        conn = await asyncpg.connect(app_dsn)
        try:
            # Not needed: the identity column's sequence (unique_for defers excepted: the
            # Permissions section grants USAGE on it for them). The doorbell needs no grant:
            # aioq's statements ring it themselves.
            rung: list[str] = []
            await owner.add_listener("aioq:aioq", lambda *args: rung.append(args[-1]))
            await aioq.admin.set_queue(owner, "limited", max_running=1000)
            await aioq.admin.set_queue(owner, "rated", rate=(1000, 60.0))
            # Wait on "rung" as a sleeping worker does, so that its insert rings.
            await statements.arm(owner, ["rung"])
            for privilege, operation in needed:
                await operation(conn)  # works with every grant
                await owner.execute(f"REVOKE {privilege} FROM {name}")
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await operation(conn)
                await owner.execute(f"GRANT {privilege} TO {name}")
            await work.options(queue="rung").defer(conn, n=0)
            await eventually(lambda: "rung" in rung, "the doorbell", HANG_GUARD)
        finally:
            await conn.close()
            await owner.close()

    asyncio.run(scenario())


DDL = [
    "ALTER TABLE aioq.jobs ADD COLUMN evil int",
    "ALTER TABLE aioq.jobs DISABLE TRIGGER ALL",
    "DROP TABLE aioq.jobs",
    "DROP TABLE aioq.archive",
    "TRUNCATE aioq.jobs",
    "DROP SCHEMA aioq CASCADE",
    "ALTER SCHEMA aioq RENAME TO evil",
    "CREATE TABLE aioq.evil (x int)",
    "CREATE INDEX evil ON aioq.jobs (task)",
    "DROP INDEX aioq.jobs_claim_idx",
    "CREATE OR REPLACE FUNCTION aioq.ring_doorbell() RETURNS trigger"
    " LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$",
    "DELETE FROM aioq.migrations",
    "CREATE SCHEMA evil",
]


def test_least_privileged_role_cannot_change_the_schema(dsn: str, app: tuple[str, str]) -> None:
    _, app_dsn = app
    tables = "SELECT count(*) FROM pg_tables WHERE schemaname = 'aioq'"
    before = value(dsn, tables)

    async def attempt_ddl() -> None:
        conn = await asyncpg.connect(app_dsn)
        try:
            for statement in DDL:
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute(statement)
            with pytest.raises(aioq.errors.SchemaError, match="owner"):
                await aioq.install(conn)
            with pytest.raises(aioq.errors.SchemaError, match="owner"):
                await aioq.install(conn, schema="fresh")
        finally:
            await conn.close()

    asyncio.run(attempt_ddl())
    for schema in ("aioq", "fresh"):
        refused = aioq_cli(app_dsn, "schema", "apply", "--schema", schema, timeout=STOP_TIMEOUT)
        message = assert_one_line_error(refused, "cannot install or upgrade schema", "owner")
        assert "permission denied" in message
    assert value(dsn, tables) == before
    assert value(dsn, "SELECT count(*) FROM pg_namespace WHERE nspname IN ('evil', 'fresh')") == 0
    owner = aioq_cli(dsn, "schema", "apply", timeout=STOP_TIMEOUT)
    latest = len(migrations())
    assert (owner.returncode, owner.stdout.strip()) == (
        0,
        f"schema aioq: up to date (version {latest})",
    )
