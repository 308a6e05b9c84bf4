"""Workflows under process faults (docs/architecture.md, "Workflows").

Three worker processes (``aioq worker --processes 3``, a child restarted when it dies) run
workflow steps with short leases while the test SIGKILLs random children. Each run of a step
records its start (database time) and what ``upstream()`` showed it, on a connection of the
task's own. At the end:

* every step succeeded (nothing lost, nothing left waiting);
* no run of a step started before every one of its dependencies' success was recorded
  (``workflow_steps.succeeded_at``, written by the statement that made the step pending);
* each run saw every dependency succeeded, with its result;
* the 200-way fan-in ran once, unless a kill hit it while it ran;
* no statement of a worker deadlocked (rows are locked in one order).

The random-DAG scenario takes its seed from ``AIOQ_CHAOS_SEED`` (printed at the start).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from harness import (
    Result,
    Sql,
    WorkerProcess,
    backends_of,
    chaos_seed,
    jitter,
    listening_pids,
    log,
    scaled,
    wait_for,
    wait_serving,
)

pytestmark = pytest.mark.chaos

PROCESSES = 3
CONCURRENCY = 10
FAN_OUT = 200
KILL_INTERVAL = 2.0
KILLS = scaled(5, 30)
DAG_RUNS = scaled(30, 60)
DAG_STEPS = scaled(12, 25)

TASKS = textwrap.dedent(
    '''
    """Workflow steps of the chaos suite: each run records its start and its upstream."""

    import asyncio
    import json
    import os

    import asyncpg

    import aioq

    registry = aioq.Registry()
    _pool = None
    _lock = None
    START = (
        "INSERT INTO wf_runs (job_id, attempt, pid, upstream)"
        " VALUES ($1, $2, $3, $4::jsonb) RETURNING id"
    )


    async def _recorder():
        global _pool, _lock
        if _lock is None:
            _lock = asyncio.Lock()
        async with _lock:
            if _pool is None:
                _pool = await asyncpg.create_pool(
                    os.environ["CHAOS_RECORD_DSN"], min_size=0, max_size=4
                )
        return _pool


    async def _record():
        job = aioq.current_job()
        up = await job.upstream()
        shown = {
            name: ("failed" if isinstance(v, aioq.StepFailed) else v) for name, v in up.items()
        }
        await (await _recorder()).execute(
            START, job.id, job.attempt, os.getpid(), json.dumps(shown)
        )
        return up


    @registry.task(name="part", lease=2.0, max_attempts=50)
    async def part(n: int, sleep: float = 0.0) -> int:
        await _record()
        await asyncio.sleep(sleep)
        return n


    @registry.task(name="fail", lease=2.0, max_attempts=1)
    async def fail(n: int) -> None:
        await _record()
        raise RuntimeError("a planned failure")


    @registry.task(name="merge", lease=2.0, max_attempts=50)
    async def merge(sleep: float = 0.0) -> int:
        up = await _record()
        await asyncio.sleep(sleep)
        return sum(v for v in up.values() if isinstance(v, int))
    '''
)

RUNS_DDL = """
CREATE TABLE wf_runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id bigint NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL,
    upstream jsonb NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

# What the flows defer: the tasks module is only imported by the workers.
DEFER = textwrap.dedent(
    """
    import asyncio, json, random, sys

    import asyncpg

    import aioq
    from wftasks import fail, merge, part

    async def main(dsn, shape, seed):
        rng = random.Random(seed)
        conn = await asyncpg.connect(dsn)
        runs = []
        async with conn.transaction():
            if shape == "fan":
                flow = aioq.Workflow("fan")
                root = flow.add(part.call(n=0), name="root")
                parts = [
                    flow.add(part.call(n=i, sleep=rng.uniform(0, 1.0)), after=[root])
                    for i in range(1, %(fan)d + 1)
                ]
                flow.add(merge.call(), after=parts, name="merge")
                runs.append((await flow.defer(conn)).id)
            else:
                failing = shape == "failing"
                for r in range(%(runs)d):
                    flow = aioq.Workflow(f"dag-{r}")
                    steps = []
                    for i in range(%(steps)d):
                        parents = rng.sample(steps, k=min(len(steps), rng.randint(0, 3)))
                        call = (merge.call(sleep=rng.uniform(0, 0.5)) if parents
                                else part.call(n=i, sleep=rng.uniform(0, 0.5)))
                        if failing and rng.random() < 0.1:
                            call = fail.call(n=i)
                        mode = "run" if failing and parents and rng.random() < 0.25 else "cancel"
                        steps.append(flow.add(call, after=parents, on_failure=mode))
                    runs.append((await flow.defer(conn)).id)
        print(json.dumps(runs))

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    """
) % {"fan": FAN_OUT, "runs": DAG_RUNS, "steps": DAG_STEPS}


def defer_flows(workdir: Path, dsn: str, shape: str, seed: int) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", DEFER, dsn, shape, str(seed)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    runs: list[int] = json.loads(out.stdout)
    return runs


def kill_while(
    fleet: WorkerProcess, sql: Sql, going: Callable[[], bool], rng: random.Random
) -> list[float]:
    """SIGKILL a random serving child every ~KILL_INTERVAL while ``going()``; return when."""
    kills: list[float] = []
    while len(kills) < KILLS and going():
        time.sleep(jitter(KILL_INTERVAL))
        fleet.assert_alive()
        serving = fleet.children() & listening_pids(sql)
        if not serving or not going():
            continue
        victim = rng.choice(sorted(serving))
        kills.append(time.time())
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda v=victim: backends_of(sql, v) == 0, f"pid {victim}'s connections gone", 60)
    return kills


def check_runs(sql: Sql, run_ids: list[int]) -> dict[str, int]:
    """Assert every step succeeded, and that no run started before its dependencies' success
    was recorded or saw a dependency not succeeded; return counts."""
    left = sql.fetch(
        "SELECT s.name, j.status, j.last_error FROM aioq.workflow_steps AS s"
        " JOIN aioq.jobs AS j ON j.id = s.job_id WHERE s.workflow_id = ANY($1) LIMIT 10",
        run_ids,
    )
    assert not left, f"steps not succeeded: {[dict(r) for r in left]}"
    steps = sql.value(
        "SELECT count(*) FROM aioq.workflow_steps WHERE workflow_id = ANY($1)", run_ids
    )
    unrecorded = sql.value(
        "SELECT count(*) FROM aioq.workflow_steps WHERE workflow_id = ANY($1)"
        " AND succeeded_at IS NULL",
        run_ids,
    )
    assert unrecorded == 0
    miscounted = sql.fetch(  # each run's own count of its successes (the workflows list's)
        "SELECT w.id, w.succeeded, w.steps FROM aioq.workflows AS w"
        " WHERE w.id = ANY($1) AND w.succeeded <> w.steps LIMIT 10",
        run_ids,
    )
    assert not miscounted, f"runs whose succeeded count is off: {[dict(r) for r in miscounted]}"
    never = sql.value(
        "SELECT count(*) FROM aioq.workflow_steps AS s WHERE s.workflow_id = ANY($1)"
        " AND NOT EXISTS (SELECT FROM wf_runs AS r WHERE r.job_id = s.job_id)",
        run_ids,
    )
    assert never == 0, f"{never} steps succeeded without a recorded run"
    early = sql.fetch(
        "SELECT r.job_id, r.started_at, p.name, p.succeeded_at"
        " FROM wf_runs AS r"
        " JOIN aioq.workflow_deps AS d ON d.job_id = r.job_id"
        " JOIN aioq.workflow_steps AS p ON p.job_id = d.parent_id"
        " WHERE p.succeeded_at >= r.started_at LIMIT 10"
    )
    assert not early, f"runs that started before a dependency succeeded: {[dict(r) for r in early]}"
    # Each run saw exactly its dependencies, each succeeded with its result.
    bad = sql.fetch(
        "SELECT r.job_id, r.upstream FROM wf_runs AS r"
        " WHERE r.upstream <> coalesce((SELECT jsonb_object_agg(p.name, p.result)"
        "   FROM aioq.workflow_deps AS d JOIN aioq.workflow_steps AS p ON p.job_id = d.parent_id"
        "   WHERE d.job_id = r.job_id), '{}'::jsonb) LIMIT 5"
    )
    assert not bad, f"runs whose upstream() was not their dependencies' results: {bad}"
    runs = sql.value("SELECT count(*) FROM wf_runs")
    return {"steps": steps, "runs": runs}


class Started(NamedTuple):
    """A scenario under way: its runs deferred, the worker processes serving them."""

    sql: Sql
    seed: int
    rng: random.Random
    run_ids: list[int]
    fleet: WorkerProcess
    started: float


def start(
    dsn: str,
    workdir: Path,
    open_sql: Callable[[str], Sql],
    fleets: Callable[..., WorkerProcess],
    shape: str,
    label: str,
) -> Started:
    """Defer the runs of ``shape`` (a seeded random choice), then start the worker processes."""
    sql = open_sql(dsn)
    sql.execute(RUNS_DDL)
    (workdir / "wftasks.py").write_text(TASKS)
    seed = chaos_seed()
    log(f"workflow {label} seed {seed}")
    rng = random.Random(seed)
    run_ids = defer_flows(workdir, dsn, shape, seed)
    started = time.monotonic()
    fleet = fleets(
        workdir, dsn, processes=PROCESSES, concurrency=CONCURRENCY, target="wftasks:registry"
    )
    wait_serving(fleet, sql)
    return Started(sql, seed, rng, run_ids, fleet, started)


def report_and_stop(
    name: str,
    fleet: WorkerProcess,
    *,
    jobs: int,
    duplicates: int,
    kills: list[float],
    started: float,
    notes: dict[str, object],
) -> None:
    """Print the scenario's result line, stop the fleet, and check that no statement of a
    worker deadlocked (the fan-in's locks are taken in one order)."""
    Result(
        name,
        jobs=jobs,
        processes=PROCESSES,
        concurrency=CONCURRENCY,
        faults=len(kills),
        lost=0,
        duplicates=duplicates,
        duplicate_bound=-1,
        recover_s=[],
        wall_s=time.monotonic() - started,
        notes=notes,
    ).report()
    fleet.stop()
    assert "deadlock" not in fleet.log()


def test_fan_out_fan_in_under_sigkill(
    dsn: str, workdir: Path, open_sql: Callable[[str], Sql], fleets: Callable[..., WorkerProcess]
) -> None:
    """A 200-way fan-out and its fan-in while worker processes are SIGKILLed: the fan-in runs
    after all 200 parents succeeded, once, and sees all 200 results."""
    sql, _, rng, run_ids, fleet, started = start(dsn, workdir, open_sql, fleets, "fan", "fan-in")
    merge_id = sql.value("SELECT job_id FROM aioq.workflow_steps WHERE name = 'merge'")

    def merge_waiting() -> bool:
        return sql.value("SELECT status FROM aioq.jobs WHERE id = $1", merge_id) == "waiting"

    kills = kill_while(fleet, sql, merge_waiting, rng)
    wait_for(
        lambda: sql.value("SELECT count(*) FROM aioq.jobs WHERE workflow_id = $1", run_ids[0]) == 0,
        "every step succeeded",
        on_timeout=fleet.log,
    )
    counts = check_runs(sql, run_ids)
    merges = sql.fetch(
        "SELECT started_at, upstream FROM wf_runs WHERE job_id = $1 ORDER BY id", merge_id
    )
    assert merges, "the fan-in never ran"
    first_up = json.loads(merges[0]["upstream"])
    assert len(merges) == 1 or any(k >= merges[0]["started_at"].timestamp() - 1 for k in kills), (
        f"the fan-in ran {len(merges)} times without a kill during its run"
    )
    assert len(first_up) == FAN_OUT, "the fan-in did not see all its parents"
    result = sql.value("SELECT result FROM aioq.workflow_steps WHERE job_id = $1", merge_id)
    assert result == str(sum(range(1, FAN_OUT + 1)))
    assert kills, "the fan-out drained before any kill: make the parts longer"
    report_and_stop(
        "workflow fan-in",
        fleet,
        jobs=counts["steps"],
        duplicates=counts["runs"] - counts["steps"],
        kills=kills,
        started=started,
        notes={"fan_in_runs": len(merges)},
    )


def test_random_dags_under_sigkill(
    dsn: str, workdir: Path, open_sql: Callable[[str], Sql], fleets: Callable[..., WorkerProcess]
) -> None:
    """Random DAGs (each step after 0-3 earlier ones) while worker processes are SIGKILLed:
    every step runs only after its dependencies succeeded, and all succeed."""
    sql, seed, rng, run_ids, fleet, started = start(
        dsn, workdir, open_sql, fleets, "dag", "random DAG"
    )
    deadline = time.monotonic() + scaled(10, 60)

    def live() -> bool:
        return time.monotonic() < deadline and bool(
            sql.value("SELECT count(*) FROM aioq.jobs WHERE workflow_id IS NOT NULL")
        )

    kills = kill_while(fleet, sql, live, rng)
    wait_for(
        lambda: sql.value("SELECT count(*) FROM aioq.jobs WHERE workflow_id IS NOT NULL") == 0,
        "every step succeeded",
        on_timeout=fleet.log,
    )
    counts = check_runs(sql, run_ids)
    report_and_stop(
        "workflow random DAGs",
        fleet,
        jobs=counts["steps"],
        duplicates=counts["runs"] - counts["steps"],
        kills=kills,
        started=started,
        notes={"seed": seed, "runs": len(run_ids)},
    )


def test_random_dags_with_failures_under_sigkill(
    dsn: str, workdir: Path, open_sql: Callable[[str], Sql], fleets: Callable[..., WorkerProcess]
) -> None:
    """Random DAGs with steps that fail for good and steps that run anyway, while worker
    processes are SIGKILLed: every run ends; a step is cancelled only when a dependency it needs
    ended dead or cancelled, and then never ran; every other step succeeded, after all its
    dependencies ended, seeing their results or their failures."""
    sql, seed, rng, run_ids, fleet, started = start(
        dsn, workdir, open_sql, fleets, "failing", "failing DAG"
    )
    live_steps = (
        "SELECT count(*) FROM aioq.jobs WHERE workflow_id IS NOT NULL"
        " AND status IN ('waiting', 'pending', 'running')"
    )
    deadline = time.monotonic() + scaled(10, 60)
    kills = kill_while(
        fleet, sql, lambda: time.monotonic() < deadline and bool(sql.value(live_steps)), rng
    )
    wait_for(lambda: sql.value(live_steps) == 0, "every run to end", on_timeout=fleet.log)
    status = "coalesce(j.status, CASE WHEN s.succeeded_at IS NOT NULL THEN 'succeeded' END)"
    steps = sql.fetch(
        f"SELECT s.job_id, s.task, s.on_failure, {status} AS status, j.last_error"
        " FROM aioq.workflow_steps AS s LEFT JOIN aioq.jobs AS j ON j.id = s.job_id"
        " WHERE s.workflow_id = ANY($1)",
        run_ids,
    )
    deps: dict[int, list[int]] = {}
    for row in sql.fetch("SELECT job_id, parent_id FROM aioq.workflow_deps"):
        deps.setdefault(row["job_id"], []).append(row["parent_id"])
    by_id = {r["job_id"]: r for r in steps}
    ran = {r["job_id"] for r in sql.fetch("SELECT DISTINCT job_id FROM wf_runs")}
    for step in steps:
        parents = [by_id[p]["status"] for p in deps.get(step["job_id"], [])]
        failed_parent = any(p in ("dead", "cancelled") for p in parents)
        if step["task"] == "fail":
            assert step["status"] in ("dead", "cancelled"), dict(step)
            continue
        if step["on_failure"] == "cancel" and failed_parent:
            assert step["status"] == "cancelled", dict(step)
            assert step["last_error"].startswith("DependencyFailed: step"), dict(step)
            assert step["job_id"] not in ran, dict(step)
        else:
            assert step["status"] == "succeeded", (dict(step), parents)
    # No run started before each of its dependencies ended (succeeded, or died or was
    # cancelled: their run_at is when), and each saw their results or their failures.
    early = sql.fetch(
        "SELECT r.job_id, r.started_at, p.name FROM wf_runs AS r"
        " JOIN aioq.workflow_deps AS d ON d.job_id = r.job_id"
        " JOIN aioq.workflow_steps AS p ON p.job_id = d.parent_id"
        " LEFT JOIN aioq.jobs AS pj ON pj.id = p.job_id"
        " WHERE coalesce(p.succeeded_at, pj.run_at) >= r.started_at LIMIT 10"
    )
    assert not early, f"runs that started before a dependency ended: {[dict(r) for r in early]}"
    bad = sql.fetch(
        "SELECT r.job_id, r.upstream FROM wf_runs AS r"
        " WHERE r.upstream <> coalesce((SELECT jsonb_object_agg(p.name,"
        "     coalesce(p.result, to_jsonb('failed'::text)))"
        "   FROM aioq.workflow_deps AS d JOIN aioq.workflow_steps AS p ON p.job_id = d.parent_id"
        "   WHERE d.job_id = r.job_id), '{}'::jsonb) LIMIT 5"
    )
    assert not bad, f"runs whose upstream() was not their dependencies' outcomes: {bad}"
    outcome = {
        s: sum(1 for r in steps if r["status"] == s) for s in ("succeeded", "dead", "cancelled")
    }
    report_and_stop(
        "workflow DAGs with failures",
        fleet,
        jobs=len(steps),
        duplicates=-1,
        kills=kills,
        started=started,
        notes={"seed": seed, **outcome},
    )
