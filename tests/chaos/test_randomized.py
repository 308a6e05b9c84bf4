"""Scenario 12: a randomized run of the core's promises under mixed faults (docs/architecture.md).

Three worker processes (``python -m aioq worker``, each its own process, restarted when it ends,
each with a concurrency and a claim-ahead drawn at start: ``--prefetch`` auto, none or fixed)
serve jobs whose leases are drawn from the allowed range and whose durations straddle them: async
and plain ``def`` tasks (some with a timeout they overstay once), tasks that snooze
(``raise aioq.Retry``) or fail once on purpose, and tasks that block their worker's event loop
past their lease (``time.sleep`` in an ``async def``), in four queues, three of them limited
(``max_running``, a rate, ``max_running_per_key``). A share of the defers are small random
workflows instead (chains, fan-out/fan-in, diamonds, groups; some steps ``on_failure="run"``)
whose steps are drawn like the jobs. Poison jobs come too (tasks that raise odd
BaseExceptions, from a coroutine or a thread, or cancel their own asyncio task; stored arguments
that do not bind), and a rolling deploy: each worker process runs the old code or the new one
(drawn at start), only the new one knows the task ``deployed``, and jobs of a task no worker
knows (``gone``) come too; at the end the deploy completes (the old workers stop gracefully and
come back new). Meanwhile the test stops workers (SIGTERM),
hard-cancels them (a second SIGTERM: ``Worker.run()`` cancelled while threads run), kills them
(SIGKILL), drops or stalls every connection through a TCP proxy (lost replies), and pauses,
resumes and re-limits the queues.

Each run of a task records its start and end (pid, worker id, outcome) in ``runs``, on a direct
connection of the task's own, so the record survives what the workers' connections go through.
At the end, with every worker stopped:

* nothing is left ``running`` (a gracefully stopped worker leaves nothing ``running`` either);
* every job is in exactly one terminal state: archived once, or dead;
* no two runs of a job overlap in time, unless on different workers and a network fault
  (a dropped or stalled connection) happened between the first run's start and the second's,
  or the first run's worker had its loop blocked then: a healthy worker keeps its lease (a
  blocked loop is a healthy worker: it never starts or goes on with a job it lost), and one
  worker never runs a job twice at once;
* every duplicate run (a run after one that was not a planned snooze or failure) is explained by
  a fault: the previous run's worker was killed, stopped or hard-cancelled (its run cut), a
  network fault hit it, or its loop was blocked.
* every workflow step's first run started after each of its dependencies had a run that
  succeeded (on the tasks' clock); a fan-in step succeeded once, unless a fault explains its
  next run as above; no step is lost (each succeeded), and ``aioq.workflow()`` agrees;
* every poison job ends dead with its own error (or a rescued attempt's), its attempts spent,
  never given back for ever, and no worker process ends unless the test stopped or killed it;
* a job of the deployed task runs on new workers only, and ends archived, or dead saying it
  waited past the workers' unknown_task_grace; a job of a task no worker knows ends dead
  saying so (docs/architecture.md, "Unknown tasks").

The seed is printed at the start and in every failure; ``AIOQ_CHAOS_SEED`` replays it.
``AIOQ_CHAOS_PROFILE=long`` (``make chaos``) runs longer with more jobs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import re
import signal
import subprocess
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from harness import PROFILE, Proxy, Sql, WorkerProcess, chaos_seed, log, scaled

import aioq
from aioq.dev.server import EmbeddedPostgres
from aioq.options import MIN_LEASE

pytestmark = pytest.mark.chaos

PROCESSES = 3
CONCURRENCIES = (3, 6)  # each worker process draws one
PREFETCHES = ("auto", "auto", "0", "2", "5")  # and its claim-ahead: auto, none or fixed
FAULT_PHASE = scaled(25, 240)  # seconds of faults
JOBS_PER_BATCH = scaled(6, 10)
MAX_LEASE = 4.0
# The jobs that block their worker's event loop (time.sleep in an async def) on their first
# run: a lease of 1-2 s, blocked 2.5-6 s, so other workers often rescue what it holds.
BLOCK_LEASE = (MIN_LEASE, 2.0)
BLOCK_SECONDS = (2.5, 6.0)
# The queues: limited ones whose limits and pause the test toggles while workers serve them.
QUEUES = ("default", "limited", "rated", "keyed")
KEYS = ("a", "b", "c")  # the keyed queue's concurrency keys
SYNC_TIMEOUT = 1.0  # the timeout of the sync task that overstays it once
GRACE = 2.0  # --shutdown-grace
REAPER = 5.0  # the worker's default reaper interval: a lost lease is reaped within it
SLACK = 3.0  # scheduling noise on a machine shared with other test runs
DRAIN_GUARD = 180.0  # hang guard: "never", not a timing
WORKFLOW_SHARE = 0.3  # of the defers: one or two small random workflows instead of jobs
NEW_SHARE = 0.6  # of the worker processes started before the deploy completes: the new code
UNKNOWN_GRACE = 8.0  # --unknown-task-grace of every worker
POISON_ATTEMPTS = 3
# Poison jobs: (task, arguments as stored) -> the first words of the error they die with.
POISON = {
    ("poison_odd", '{"kind": "odd"}'): "Odd: odd",
    ("poison_odd", '{"kind": "interrupt"}'): "KeyboardInterrupt",
    ("poison_odd", '{"kind": "exit"}'): "SystemExit: 3",
    ("poison_sync", "{}"): "Odd: odd in a thread",
    ("poison_cancel", "{}"): "RuntimeError: the task cancelled its own asyncio task",
    ("work", "[1, 2]"): "PayloadError: cannot call 'work' with its stored arguments",
    ("work", '{"nope": 1}'): "PayloadError: cannot call 'work' with its stored arguments",
    ("gone", "{}"): "UnknownTaskError: no task named 'gone' is registered",
}

TASKS = textwrap.dedent(
    '''
    """Tasks of the randomized scenario: every run records its start and end in ``runs``."""

    import asyncio
    import os
    import threading
    import time

    import anyio
    import asyncpg

    import aioq

    registry = aioq.Registry()
    DSN = os.environ["CHAOS_RECORD_DSN"]
    QUICK = aioq.Backoff(base=0.2, factor=2, max=1.0)
    SYNC_TIMEOUT = float(os.environ["CHAOS_SYNC_TIMEOUT"])
    # A run's start and end are the task's own clock (this machine's, like the server's and
    # the test's): the start is taken on the task's first line, in the same step of the event
    # loop as the worker's decision to start it, so a loop blocked before the record is sent
    # does not make a run look later than it was.
    START = (
        "INSERT INTO runs (job_id, attempt, pid, worker_id, kind, started_at)"
        " VALUES ($1, $2, $3, $4, $5, to_timestamp($6))"
        " RETURNING id, (SELECT count(*) FILTER (WHERE outcome = 'snooze') FROM runs"
        "                WHERE job_id = $1) AS snoozed,"
        "   (SELECT count(*) FILTER (WHERE outcome IN ('fail', 'timeout')) FROM runs"
        "    WHERE job_id = $1) AS failed,"
        "   (SELECT count(*) FROM runs WHERE job_id = $1) AS prior"
    )
    END = "UPDATE runs SET ended_at = to_timestamp($3), outcome = $2 WHERE id = $1"
    BLOCKING = "UPDATE runs SET kind = 'block' WHERE id = $1"
    _pool = None
    _lock = None
    _local = threading.local()


    async def _recorder():
        global _pool, _lock
        if _lock is None:
            _lock = asyncio.Lock()
        async with _lock:
            if _pool is None:
                _pool = await asyncpg.create_pool(DSN, min_size=0, max_size=8)
        return _pool


    def _plan(row, snoozes, fail_once):
        if row["snoozed"] < snoozes:
            return "snooze"
        if fail_once and row["failed"] == 0:
            return "fail"
        return None


    def _raise(plan):
        if plan == "snooze":
            raise aioq.Retry(delay=0.05)
        if plan == "fail":
            raise RuntimeError("a planned failure")


    @registry.task(name="work", max_attempts=25, retry=QUICK)
    async def work(seconds: float, snoozes: int = 0, fail_once: bool = False) -> None:
        began = time.time()
        job = aioq.current_job()
        with anyio.CancelScope(shield=True):  # a cancel waits until the start is recorded
            row = await (await _recorder()).fetchrow(
                START, job.id, job.attempt, os.getpid(), job.worker_id, "async", began
            )
        outcome = "cancelled"
        try:
            plan = _plan(row, snoozes, fail_once)
            if plan:
                outcome = plan
                _raise(plan)
            await asyncio.sleep(seconds)
            outcome = "ok"
        finally:
            ended = time.time()
            with anyio.CancelScope(shield=True):
                await (await _recorder()).execute(END, row["id"], outcome, ended)


    @registry.task(name="block", max_attempts=25, retry=QUICK)
    async def block(seconds: float) -> None:
        """Block the event loop (time.sleep in an async def) for ``seconds``, past the job's
        lease, on its first run only; later runs (after a rescue) return at once."""
        began = time.time()
        job = aioq.current_job()
        with anyio.CancelScope(shield=True):  # a cancel waits until the start is recorded
            pool = await _recorder()
            row = await pool.fetchrow(
                START, job.id, job.attempt, os.getpid(), job.worker_id, "block_rerun", began
            )
        outcome = "cancelled"
        try:
            if row["prior"] == 0:
                with anyio.CancelScope(shield=True):  # marked a block only if it blocks
                    await pool.execute(BLOCKING, row["id"])
                time.sleep(seconds)  # the whole worker stalls: no heartbeat, claim or outcome
            outcome = "ok"
        finally:
            ended = time.time()  # a lost lease cancels it at its next await
            with anyio.CancelScope(shield=True):
                await pool.execute(END, row["id"], outcome, ended)


    def _sync(query, *args):
        """Run one statement on this thread's own connection (and event loop)."""
        if getattr(_local, "loop", None) is None:
            _local.loop, _local.conn = asyncio.new_event_loop(), None

        async def go():
            if _local.conn is None or _local.conn.is_closed():
                _local.conn = await asyncpg.connect(DSN)
            return await _local.conn.fetchrow(query, *args)

        return _local.loop.run_until_complete(go())


    def _sync_run(kind, seconds, snoozes, fail_once, overstay):
        began = time.time()
        job = aioq.current_job()
        row = _sync(START, job.id, job.attempt, os.getpid(), job.worker_id, kind, began)
        outcome = "cancelled"
        try:
            plan = _plan(row, snoozes, fail_once)
            if plan:
                outcome = plan
                _raise(plan)
            if overstay and row["failed"] == 0:
                outcome = "timeout"  # planned: the first run overstays the task's timeout
                time.sleep(SYNC_TIMEOUT * 1.5)
                return
            time.sleep(seconds)
            outcome = "ok"
        finally:
            _sync(END + " RETURNING id", row["id"], outcome, time.time())


    # The new code's task: like work; the old code (old_registry) does not know it.
    deployed = registry.task(name="deployed", max_attempts=25, retry=QUICK)(work.fn)


    class Odd(BaseException):
        """Neither an Exception nor a cancellation."""


    POISON = aioq.Backoff(base=0.1, max=0.3)


    @registry.task(name="poison_odd", max_attempts=3, retry=POISON)
    async def poison_odd(kind: str) -> None:
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "exit":
            raise SystemExit(3)
        raise Odd("odd")


    @registry.task(name="poison_sync", max_attempts=3, retry=POISON)
    def poison_sync() -> None:
        raise Odd("odd in a thread")


    @registry.task(name="poison_cancel", max_attempts=3, retry=POISON)
    async def poison_cancel() -> None:
        asyncio.current_task().cancel()
        await asyncio.sleep(3600)


    @registry.task(name="sync_work", max_attempts=25, retry=QUICK)
    def sync_work(seconds: float, snoozes: int = 0, fail_once: bool = False) -> None:
        _sync_run("sync", seconds, snoozes, fail_once, overstay=False)


    @registry.task(name="sync_timeout", max_attempts=25, retry=QUICK, timeout=SYNC_TIMEOUT)
    def sync_timeout(seconds: float, snoozes: int = 0, fail_once: bool = False) -> None:
        _sync_run("sync_timeout", seconds, snoozes, fail_once, overstay=True)


    # The old code, before the deploy: every task but the deployed one.
    old_registry = aioq.Registry()
    for _name in registry:
        if _name != "deployed":
            old_registry.add(registry.get(_name))
    '''
)

RUNS_DDL = """
CREATE TABLE runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id bigint NOT NULL,
    attempt integer NOT NULL,
    pid integer NOT NULL,
    worker_id text NOT NULL,
    kind text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz,
    outcome text
)
"""

PLANNED = ("snooze", "fail", "timeout")  # outcomes after which another run is expected


@dataclass
class Fault:
    """One injected event: a worker killed or stopped, or the network dropped or stalled."""

    kind: str  # kill, stop, cancel (stop, then a second SIGTERM: a hard cancel), drop, stall
    started: float  # epoch seconds
    ended: float
    pid: int | None = None  # the worker it hit (None: every worker, through the proxy)
    cancelled: float | None = None  # a hard cancel: when the second SIGTERM was sent


@dataclass
class Slot:
    """One of the three worker processes; a new one is started when it has ended."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    exits: dict[int, float] = field(default_factory=dict)  # pid -> when it was seen gone
    stopping: Fault | None = None
    restart_at: float = 0.0
    cancel_at: float = float("inf")  # when to send the second SIGTERM of a hard cancel


class Workers:
    """The worker processes, started through the proxy, logs in ``workdir``."""

    def __init__(self, workdir: Path, dsn: str, record_dsn: str, rng: random.Random) -> None:
        self.workdir = workdir
        self.dsn = dsn
        self.env = {"CHAOS_RECORD_DSN": record_dsn, "CHAOS_SYNC_TIMEOUT": str(SYNC_TIMEOUT)}
        self.slots = [Slot(i) for i in range(PROCESSES)]
        self.rng = rng
        self.started = 0
        self.configs: Counter[str] = Counter()  # concurrency/prefetch of the processes started
        self.versions: dict[int, str] = {}  # pid -> "old" or "new" code
        self.deployed = False  # the deploy completed: every process starts with the new code
        self.killed: set[int] = set()  # pids the test killed (SIGKILL)
        self.unexpected: list[str] = []  # processes that ended though nobody stopped them

    def start(self, slot: Slot) -> None:
        concurrency, prefetch = self.rng.choice(CONCURRENCIES), self.rng.choice(PREFETCHES)
        version = "new" if self.deployed or self.rng.random() < NEW_SHARE else "old"
        self.configs[f"c{concurrency}/p{prefetch}/{version}"] += 1
        args = ["--concurrency", str(concurrency), "--prefetch", prefetch, "--poll-interval", "0.2"]
        args += ["--shutdown-grace", str(GRACE), "--keep-completed", "--log-format", "json"]
        args += ["--command-timeout", "5", "--unknown-task-grace", str(UNKNOWN_GRACE)]
        for queue in QUEUES:
            args += ["--queue", queue]
        target = "randomtasks:registry" if version == "new" else "randomtasks:old_registry"
        worker = WorkerProcess(target, *args, dsn=self.dsn, cwd=self.workdir, env=self.env)
        slot.proc = worker.start().proc
        assert slot.proc is not None
        self.versions[slot.proc.pid] = version
        self.started += 1
        slot.stopping = None
        slot.cancel_at = float("inf")

    def alive(self) -> list[Slot]:
        return [s for s in self.slots if s.proc is not None and s.proc.poll() is None]

    def reap(self, now: float, rng: random.Random) -> list[int]:
        """Note workers that ended, restart their slots after a pause; return the ended pids."""
        ended = []
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None and now >= slot.cancel_at:
                slot.proc.send_signal(signal.SIGTERM)  # again: Worker.run() is cancelled
                slot.cancel_at = float("inf")
                if slot.stopping is not None:
                    slot.stopping.cancelled = now
            if slot.proc is not None and slot.proc.poll() is not None:
                slot.exits[slot.proc.pid] = now
                if slot.stopping is None and slot.proc.pid not in self.killed:
                    self.unexpected.append(
                        f"worker pid {slot.proc.pid} ended by itself (exit {slot.proc.returncode})"
                    )
                if slot.stopping is not None:
                    slot.stopping.ended = now
                ended.append(slot.proc.pid)
                slot.proc = None
                slot.restart_at = now + rng.uniform(0.2, 1.5)
            if slot.proc is None and now >= slot.restart_at:
                self.start(slot)
        return ended

    def complete_deploy(self, now: float, faults: list[Fault]) -> None:
        """The deploy completes: every old worker stops gracefully; all come back new."""
        self.deployed = True
        for slot in self.alive():
            assert slot.proc is not None
            if self.versions[slot.proc.pid] == "old" and slot.stopping is None:
                slot.proc.send_signal(signal.SIGTERM)
                slot.stopping = Fault("stop", now, float("inf"), slot.proc.pid)
                faults.append(slot.stopping)

    def kill_all(self) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.kill()
                slot.proc.wait(30)


@pytest.fixture
def workers(workdir: Path) -> Iterator[Callable[[str, str, random.Random], Workers]]:
    made: list[Workers] = []

    def make(dsn: str, record_dsn: str, rng: random.Random) -> Workers:
        made.append(Workers(workdir, dsn, record_dsn, rng))
        return made[-1]

    yield make
    for group in made:
        group.kill_all()


@dataclass(frozen=True)
class Plan:
    """One job as drawn: its task, arguments, lease, queue and concurrency key."""

    task: str
    args: dict[str, Any]
    lease: float
    queue: str
    key: str | None


def _draw(rng: random.Random, *, deployed: bool = True) -> Plan:
    """A job with a random task, lease, duration, snoozes and failure, in a random queue
    (``deployed``: the new code's task may be drawn)."""
    lease = round(rng.uniform(MIN_LEASE, MAX_LEASE), 2)
    kinds = ["work", "sync_work", "sync_timeout", "block", "deployed"]
    kind = rng.choices(kinds, weights=[6, 2, 1, 0.25, 1.5 if deployed else 0])[0]
    queue = rng.choices(QUEUES, weights=[5, 1, 1, 1])[0]
    key = rng.choice(KEYS) if queue == "keyed" else None
    if kind == "block":
        lease = round(rng.uniform(*BLOCK_LEASE), 2)
        return Plan(kind, {"seconds": round(rng.uniform(*BLOCK_SECONDS), 3)}, lease, queue, key)
    long_run = rng.random() < 0.35
    seconds = lease * rng.uniform(0.3, 1.8) if long_run else rng.uniform(0.0, 0.2)
    if kind == "sync_timeout":
        seconds = min(seconds, SYNC_TIMEOUT / 2)  # later runs stay inside the timeout
    args = {
        "seconds": round(seconds, 3),
        "snoozes": rng.choice([0, 0, 0, 1, 2, 3]),
        "fail_once": rng.random() < 0.1,
    }
    return Plan(kind, args, lease, queue, key)


def _defer(sql: Sql, rng: random.Random, count: int) -> dict[int, float]:
    """Defer ``count`` jobs drawn by :func:`_draw`; return the lease of each job id."""
    plans = [_draw(rng) for _ in range(count)]
    rows = sql.fetch(
        "INSERT INTO aioq.jobs (task, args, lease, max_attempts, queue, concurrency_key)"
        " SELECT t, a::jsonb, make_interval(secs => l), 25, q, k"
        " FROM unnest($1::text[], $2::text[], $3::float8[], $4::text[], $5::text[])"
        " AS u(t, a, l, q, k) RETURNING id",
        [p.task for p in plans],
        [json.dumps(p.args) for p in plans],
        [p.lease for p in plans],
        [p.queue for p in plans],
        [p.key for p in plans],
    )
    return {r["id"]: p.lease for r, p in zip(rows, plans, strict=True)}


# Stand-ins of the workers' tasks (same names and signatures) for the test to build workflow
# steps with Task.call: the test only defers them; the workers run randomtasks' own.
STEPS = aioq.Registry()


@STEPS.task(name="work", max_attempts=25)
async def _work(seconds: float, snoozes: int = 0, fail_once: bool = False) -> None: ...


@STEPS.task(name="block", max_attempts=25)
async def _block(seconds: float) -> None: ...


@STEPS.task(name="sync_work", max_attempts=25)
def _sync_work(seconds: float, snoozes: int = 0, fail_once: bool = False) -> None: ...


@STEPS.task(name="sync_timeout", max_attempts=25, timeout=SYNC_TIMEOUT)
def _sync_timeout(seconds: float, snoozes: int = 0, fail_once: bool = False) -> None: ...


STEP_TASKS: dict[str, aioq.Task[..., None]] = {
    "work": _work, "block": _block, "sync_work": _sync_work, "sync_timeout": _sync_timeout
}  # fmt: skip
SHAPES = ("chain", "fan", "diamond", "group")


@dataclass
class Flow:
    """A workflow run the test deferred: its steps' job ids, dependencies and failure modes."""

    id: int
    shape: str
    jobs: dict[str, int]  # step name -> job id
    after: dict[str, list[str]]  # step name -> its dependencies' names
    on_failure: dict[str, str]


def _shape(rng: random.Random) -> tuple[str, list[tuple[str, list[str]]]]:
    """A small random workflow: (shape, [(step name, its dependencies)] in order)."""
    shape = rng.choice(SHAPES)
    if shape == "chain":  # s1 -> s2 (-> s3)
        names = [f"s{i}" for i in range(1, rng.randint(2, 3) + 1)]
        return shape, [(n, names[i - 1 : i]) for i, n in enumerate(names)]
    if shape == "diamond":  # top -> left, right -> bottom
        return shape, [("top", []), ("left", ["top"]), ("right", ["top"]), ("bottom", ["left", "right"])]  # fmt: skip
    parts = [f"p{i}" for i in range(1, rng.randint(2, 4) + 1)]
    if shape == "group":  # p1..pn -> merge
        return shape, [*((p, []) for p in parts), ("merge", parts)]
    return shape, [("root", []), *((p, ["root"]) for p in parts), ("merge", parts)]  # fan


def _defer_flows(sql: Sql, rng: random.Random, count: int) -> tuple[list[Flow], dict[int, float]]:
    """Defer ``count`` random workflows whose steps are drawn like the plain jobs (task,
    lease, duration, snoozes, failure, queue), some steps with ``on_failure="run"``; return
    them and the lease of each step's job id."""
    flows, leases = [], {}
    for _ in range(count):
        shape, steps = _shape(rng)
        flow = aioq.Workflow(f"chaos-{shape}")
        made: dict[str, aioq.workflows.Step] = {}
        on_failure: dict[str, str] = {}
        step_leases: dict[str, float] = {}
        for name, after in steps:
            plan = _draw(rng, deployed=False)  # a step dead past the grace would fail its run
            mode = "run" if after and rng.random() < 0.3 else "cancel"
            call = (
                STEP_TASKS[plan.task]
                .options(
                    queue=plan.queue, lease=plan.lease, max_attempts=25, concurrency_key=plan.key
                )
                .call(**plan.args)
            )
            made[name] = flow.add(call, after=[made[a] for a in after], name=name, on_failure=mode)
            on_failure[name] = mode
            step_leases[name] = plan.lease

        async def defer(conn: Any, flow: aioq.Workflow = flow) -> aioq.workflows.WorkflowRun:
            async with conn.transaction():
                return await flow.defer(conn)

        run = sql._run(defer)
        flows.append(Flow(run.id, shape, dict(run.jobs), dict(steps), on_failure))
        leases.update({run.jobs[n]: lease for n, lease in step_leases.items()})
    return flows, leases


def _epoch(at: datetime | None) -> float | None:
    return None if at is None else at.timestamp()


def _run_end(run: dict[str, Any], exits: dict[int, float], kills: dict[int, float]) -> float:
    """When a run ended: recorded, or its process's death (a SIGKILL leaves no record)."""
    if run["ended"] is not None:
        return float(run["ended"])
    return kills.get(run["pid"], exits.get(run["pid"], float("inf")))


def _net_fault_between(faults: list[Fault], start: float, end: float) -> Fault | None:
    for fault in faults:
        if fault.kind in ("drop", "stall") and fault.started <= end and fault.ended >= start:
            return fault
    return None


def _blocks(
    runs: list[dict[str, Any]], exits: dict[int, float], kills: dict[int, float]
) -> dict[int, list[tuple[float, float]]]:
    """When each worker's event loop was blocked: the runs that blocked it (pid -> spans)."""
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        if run["kind"] == "block":
            spans[run["pid"]].append((run["started"], _run_end(run, exits, kills)))
    return spans


def _blocked_between(
    blocks: dict[int, list[tuple[float, float]]], pid: int, start: float, end: float
) -> float | None:
    """When the last block of worker ``pid``'s event loop in [start, end] ended, if any: then
    it could extend no lease and write no outcome, and its claims may have lapsed (a blocked
    loop is a healthy worker: it must not start or go on with a job it may have lost)."""
    ends = [b_end for b_start, b_end in blocks.get(pid, ()) if b_start <= end and b_end >= start]
    return max(ends) if ends else None


def analyse(
    runs: list[dict[str, Any]],
    faults: list[Fault],
    exits: dict[int, float],
    leases: dict[int, float],
    explained: set[int] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """Check overlaps and duplicates against the faults; return (violations, figures).

    ``explained`` receives the ids of the duplicate runs a fault explains.
    """
    kills = {f.pid: f.started for f in faults if f.kind == "kill" and f.pid is not None}
    stops = {f.pid: f for f in faults if f.kind in ("stop", "cancel") and f.pid is not None}
    blocks = _blocks(runs, exits, kills)
    by_job: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_job[run["job_id"]].append(run)
    violations: list[str] = []
    figures: Counter[str] = Counter()
    for job, job_runs in sorted(by_job.items()):
        job_runs.sort(key=lambda r: r["started"])
        lease = leases[job]
        for i, first in enumerate(job_runs):
            first_end = _run_end(first, exits, kills)
            for second in job_runs[i + 1 :]:
                if second["started"] >= first_end:
                    continue
                figures["overlaps"] += 1
                what = (
                    f"job {job} (lease {lease}s): run {first['id']} [{first['kind']}, pid"
                    f" {first['pid']}, attempt {first['attempt']}, {first['outcome']}] overlaps"
                    f" run {second['id']} [pid {second['pid']}, attempt {second['attempt']}]"
                    f" by {min(first_end, _run_end(second, exits, kills)) - second['started']:.2f}s"
                )
                if first["pid"] == second["pid"]:
                    violations.append(f"{what}, on the same worker")
                elif _net_fault_between(faults, first["started"], second["started"]):
                    figures["overlaps_explained"] += 1
                elif (
                    unblocked := _blocked_between(
                        blocks, first["pid"], first["started"], second["started"]
                    )
                ) is not None:
                    # The first run's worker could not extend its lease: its loop was blocked
                    # (by a task) before the second run began. Only the first run's worker:
                    # one whose loop was blocked must not start a job another one runs.
                    figures["overlaps_explained"] += 1
                    figures["overlaps_blocked"] += 1
                    # How long an async first run went on once its loop was free (a figure
                    # only: until its heartbeat found the claim lost and cancelled it, or it
                    # ended; a thread cannot be stopped).
                    after = round(1000 * max(0.0, first_end - unblocked))
                    if first["kind"] == "async":
                        figures["after_block_ms_max"] = max(figures["after_block_ms_max"], after)
                else:
                    violations.append(
                        f"{what}, with no network fault or blocked loop in between (healthy"
                        " workers)"
                    )
        for prev, run in itertools.pairwise(job_runs):
            if prev["outcome"] in PLANNED:
                continue
            figures["duplicates"] += 1
            prev_end = _run_end(prev, exits, kills)
            why = None
            if prev["pid"] in kills and kills[prev["pid"]] >= prev["started"] - SLACK:
                why = "killed"
            elif prev["pid"] in stops and prev["outcome"] in ("cancelled", None):
                why = "stopped"
            elif _net_fault_between(faults, prev["started"] - lease, min(prev_end, run["started"]) + SLACK):  # fmt: skip
                why = "network"
            elif _blocked_between(blocks, prev["pid"], prev["started"], run["started"]) is not None:
                # Its loop blocked during the run or before its outcome was written.
                why = "blocked"
            if why is None:
                violations.append(
                    f"job {job}: run {run['id']} (pid {run['pid']}, attempt {run['attempt']})"
                    f" repeats run {prev['id']} (pid {prev['pid']}, attempt {prev['attempt']},"
                    f" {prev['kind']}, outcome {prev['outcome']}) with no fault to explain it"
                )
            else:
                figures[f"duplicates_{why}"] += 1
                if explained is not None:
                    explained.add(run["id"])
    for fault in faults:  # hard cancels that caught plain def tasks' threads running
        if fault.cancelled is not None and any(
            r["pid"] == fault.pid
            and r["kind"].startswith("sync")
            and r["started"] <= fault.cancelled <= _run_end(r, exits, kills)
            for r in runs
        ):
            figures["cancels_with_threads"] += 1
    return violations, dict(figures)


def analyse_flows(
    flows: list[Flow],
    infos: dict[int, aioq.admin.WorkflowInfo | None],
    runs: list[dict[str, Any]],
    explained: set[int],
) -> tuple[list[str], dict[str, Any]]:
    """Check every workflow run against its steps' runs; return (violations, figures).

    * a step's first run started only after each of its dependencies had a run that ended in
      success (``ok``), on the tasks' own clock: the success is recorded after that end, and the
      step made pending only then (an ``on_failure="run"`` step too: its dependencies all
      succeed here, as the scenario's tasks eventually do);
    * a fan-in step (two dependencies or more) ran to success once, unless each later success
      repeats the run before it for a fault :func:`analyse` explains (``explained``);
    * no step is lost: every step has a successful run, and ``aioq.workflow()`` shows the run
      succeeded with each step succeeded, under the job id, dependencies and failure mode the
      test deferred it with.
    """
    by_job: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_job[run["job_id"]].append(run)
    for job_runs in by_job.values():
        job_runs.sort(key=lambda r: r["started"])
    violations: list[str] = []
    figures: Counter[str] = Counter()
    for flow in flows:
        figures[f"flows_{flow.shape}"] += 1
        where = f"workflow {flow.id} ({flow.shape})"
        for name, job in flow.jobs.items():
            figures["steps"] += 1
            step_runs = by_job.get(job, [])
            successes = [r for r in step_runs if r["outcome"] == "ok"]
            if not successes:
                violations.append(f"{where}: step {name!r} (job {job}) never succeeded (lost)")
            after = flow.after[name]
            if flow.on_failure[name] == "run":
                figures["steps_on_failure_run"] += 1
            if step_runs and after:
                first = step_runs[0]
                for parent in after:
                    ends = [r["ended"] for r in by_job.get(flow.jobs[parent], []) if r["outcome"] == "ok"]  # fmt: skip
                    if not ends:
                        violations.append(
                            f"{where}: step {name!r} (job {job}) ran (run {first['id']}) though"
                            f" its dependency {parent!r} never succeeded"
                        )
                    elif first["started"] < min(ends):
                        violations.append(
                            f"{where}: step {name!r} (job {job}) started (run {first['id']})"
                            f" {min(ends) - first['started']:.3f}s before its dependency"
                            f" {parent!r} succeeded"
                        )
            if len(after) >= 2:
                figures["fan_ins"] += 1
                for ok in successes[:-1]:
                    later = step_runs[step_runs.index(ok) + 1]
                    if later["id"] in explained:
                        figures["fan_in_reruns_explained"] += 1
                    else:
                        violations.append(
                            f"{where}: fan-in step {name!r} (job {job}) succeeded in run"
                            f" {ok['id']}, then ran again (run {later['id']}) with no fault to"
                            " explain it"
                        )
        info = infos.get(flow.id)
        if info is None:
            violations.append(f"{where}: aioq.workflow() finds no such run")
            continue
        if info.state != "succeeded" or info.counts.get("succeeded") != len(flow.jobs):
            violations.append(f"{where}: aioq.workflow() says {info.state} {info.counts}")
        shown = {s.name: (s.job_id, sorted(s.after), s.on_failure, s.status) for s in info.steps}
        deferred = {
            n: (j, sorted(flow.after[n]), flow.on_failure[n], "succeeded")
            for n, j in flow.jobs.items()
        }
        if shown != deferred:
            violations.append(f"{where}: aioq.workflow() shows {shown}, deferred {deferred}")
    return violations, dict(figures)


def _workflows(sql: Sql, flows: list[Flow]) -> dict[int, aioq.admin.WorkflowInfo | None]:
    """What ``aioq.workflow()`` says of each run."""
    return {f.id: sql._run(lambda c, f=f: aioq.workflow(c, f.id)) for f in flows}


def test_randomized_faults_keep_the_core_promises(
    own_server: EmbeddedPostgres,
    own_dsn: str,
    workdir: Path,
    workers: Callable[[str, str, random.Random], Workers],
) -> None:
    seed = chaos_seed()
    rng = random.Random(seed)
    log(f"randomized scenario: seed {seed} (AIOQ_CHAOS_SEED={seed} replays it)")
    (workdir / "randomtasks.py").write_text(TASKS)
    sql = Sql(own_dsn)
    sql.execute(RUNS_DDL)
    faults: list[Fault] = []
    violations: list[str] = []
    leases: dict[int, float] = {}
    flows: list[Flow] = []
    poison: dict[int, str] = {}  # job id -> the error it must die with
    limits = Limits(sql, rng)
    try:
        with Proxy("127.0.0.1", own_server.port) as proxy:
            proxied = own_dsn.replace(f":{own_server.port}/", f":{proxy.port}/")
            fleet = workers(proxied, own_dsn, rng)
            for slot in fleet.slots:
                fleet.start(slot)
            deadline = time.monotonic() + FAULT_PHASE
            while time.monotonic() < deadline:
                now = time.time()
                for pid in fleet.reap(now, rng):
                    violations += _left_running(sql, pid, faults)
                action = rng.choices(
                    [
                        "defer",
                        "kill",
                        "stop",
                        "cancel",
                        "drop",
                        "stall",
                        "limits",
                        "poison",
                        "wait",
                    ],
                    weights=[4, 0.4, 0.4, 0.3, 0.5, 0.3, 0.8, 0.6, 2],
                )[0]
                alive = fleet.alive()
                if action == "defer" and rng.random() < WORKFLOW_SHARE:
                    made, step_leases = _defer_flows(sql, rng, rng.randint(1, 2))
                    flows += made
                    leases.update(step_leases)
                elif action == "defer":
                    leases.update(_defer(sql, rng, rng.randint(1, JOBS_PER_BATCH)))
                elif action == "kill" and alive:
                    slot = rng.choice(alive)
                    assert slot.proc is not None
                    fleet.killed.add(slot.proc.pid)
                    slot.proc.send_signal(signal.SIGKILL)
                    faults.append(Fault("kill", now, now, slot.proc.pid))
                elif action in ("stop", "cancel") and alive:
                    candidates = [s for s in alive if s.stopping is None] or alive
                    if action == "cancel":  # rather a worker with a def task's thread running
                        candidates = _running_threads(sql, candidates) or candidates
                    slot = rng.choice(candidates)
                    assert slot.proc is not None
                    slot.proc.send_signal(signal.SIGTERM)
                    if slot.stopping is None:
                        slot.stopping = Fault(action, now, float("inf"), slot.proc.pid)
                        faults.append(slot.stopping)
                    if action == "cancel":
                        # The second SIGTERM cancels Worker.run() (the CLI's "again: at once"),
                        # mostly within the grace, while plain def tasks' threads still run.
                        slot.cancel_at = now + rng.uniform(0.0, GRACE * 0.75)
                elif action == "limits":
                    limits.toggle()
                elif action == "poison":
                    poison.update(_defer_poison(sql, rng))
                elif action == "drop":
                    proxy.drop_all()
                    faults.append(Fault("drop", now, time.time()))
                elif action == "stall":
                    seconds = rng.uniform(0.2, 1.5)
                    proxy.stall(seconds)
                    faults.append(Fault("stall", now, now + seconds))
                time.sleep(rng.uniform(0.1, 0.6))
            log(
                f"faults injected: {Counter(f.kind for f in faults)}; {len(leases)} jobs,"
                f" {len(flows)} workflows"
            )
            limits.lift()
            fleet.complete_deploy(time.time(), faults)
            violations += _drain(sql, fleet, rng, faults)
            violations += fleet.unexpected
        runs, exits = _collect(sql, fleet)
        explained: set[int] = set()
        found, figures = analyse(runs, faults, exits, leases, explained)
        violations += found
        found, flow_figures = analyse_flows(flows, _workflows(sql, flows), runs, explained)
        violations += found
        figures.update(flow_figures)
        violations += _terminal(sql, list(leases))
        found, poison_figures = _poison_ended(sql, poison, runs, fleet.versions)
        violations += found
        figures.update(poison_figures)
        blocked = sum(1 for r in runs if r["kind"] == "block")
        summary = (
            f"{len(leases)} jobs ({len(flows)} workflows, {len(poison)} poison), {len(runs)} runs, {fleet.started} worker processes"
            f" {dict(fleet.configs)}, faults {dict(Counter(f.kind for f in faults))},"
            f" {blocked} blocked loops, queue changes {dict(limits.changes)}, {figures}"
        )
        log(f"RESULT randomized [{PROFILE}] seed {seed}: {summary}")
        report = os.environ.get("AIOQ_CHAOS_REPORT")
        if report:
            with open(report, "a") as out:
                out.write(json.dumps({"scenario": "12 randomized", "profile": PROFILE, "seed": seed, "jobs": len(leases), "workflows": len(flows), "runs": len(runs), "faults": dict(Counter(f.kind for f in faults)), "blocked": blocked, "queue_changes": dict(limits.changes), "violations": len(violations), **figures}) + "\n")  # fmt: skip
    finally:
        sql.close()
    assert not violations, (
        f"seed {seed} (rerun with AIOQ_CHAOS_SEED={seed}): {len(violations)} violations"
        f" ({summary}):\n" + "\n".join(violations[:40])
    )


def _defer_poison(sql: Sql, rng: random.Random) -> dict[int, str]:
    """Insert one to three poison jobs (or jobs of a task no worker knows); return the error
    each must die with."""
    drawn = [rng.choice(list(POISON)) for _ in range(rng.randint(1, 3))]
    rows = sql.retrying(
        lambda: sql.fetch(
            "INSERT INTO aioq.jobs (task, args, max_attempts, lease)"
            " SELECT t, a::jsonb, $3, interval '2 seconds'"
            " FROM unnest($1::text[], $2::text[]) AS u(t, a) RETURNING id",
            [task for task, _ in drawn],
            [args for _, args in drawn],
            POISON_ATTEMPTS,
        )
    )
    return {r["id"]: POISON[key] for r, key in zip(rows, drawn, strict=True)}


def _poison_ended(
    sql: Sql, poison: dict[int, str], runs: list[dict[str, Any]], versions: dict[int, str]
) -> tuple[list[str], dict[str, Any]]:
    """Every poison job ended dead with its error, its attempts spent (a job of a task no
    worker knows: refunded while it waited); the deployed task ran on new workers only, and
    a job of it that is dead says it waited past the grace."""
    violations: list[str] = []
    figures: Counter[str] = Counter()
    rows = {
        r["id"]: r
        for r in sql.fetch(
            "SELECT id, task, status, attempts, last_error FROM aioq.jobs"
            " WHERE id = ANY($1) OR task = 'deployed'",
            list(poison),
        )
    }
    for job_id, expected in sorted(poison.items()):
        row = rows.get(job_id)
        if row is None or row["status"] != "dead":
            violations.append(f"poison job {job_id} ({expected}) did not end dead: {row}")
            continue
        error = row["last_error"] or ""
        if not (error.startswith(expected) or error.startswith("LeaseExpired")):
            violations.append(f"poison job {job_id} died with {error[:200]!r}, not {expected!r}")
        gone = expected.startswith("UnknownTaskError")
        if not gone and row["attempts"] != POISON_ATTEMPTS:
            violations.append(
                f"poison job {job_id} ({expected}) dead after {row['attempts']} attempts"
            )
        figures["poison_unknown_dead" if gone else "poison_dead"] += 1
    on_old = [r for r in runs if r["kind"] == "async" and versions.get(r["pid"]) == "old"]
    deployed = {j for j, r in rows.items() if r["task"] == "deployed"}
    deployed |= {r["id"] for r in sql.fetch("SELECT id FROM aioq.archive WHERE task = 'deployed'")}
    figures["deployed"] = len(deployed)
    for run in on_old:
        if run["job_id"] in deployed:
            violations.append(f"deployed job {run['job_id']} ran on an old worker (run {run})")
    for job_id in sorted(deployed & set(rows)):
        row = rows[job_id]
        waited = re.search(r"it waited (\d+)s\)", row["last_error"] or "")
        if row["status"] != "dead":
            continue
        figures["deployed_dead"] += 1
        if waited is None or float(waited[1]) < UNKNOWN_GRACE:
            violations.append(f"deployed job {job_id} dead: {row['last_error']!r}")
    return violations, dict(figures)


def _running_threads(sql: Sql, slots: list[Slot]) -> list[Slot]:
    """The slots whose worker runs a plain def task in a thread now (as far as ``runs`` says)."""
    pids = {
        r["pid"]
        for r in sql.retrying(
            lambda: sql.fetch(
                "SELECT DISTINCT pid FROM runs WHERE ended_at IS NULL AND kind LIKE 'sync%'"
            )
        )
    }
    return [s for s in slots if s.proc is not None and s.proc.pid in pids]


class Limits:
    """The limited queues' settings, toggled while workers serve them (aioq.admin.set_queue)."""

    def __init__(self, sql: Sql, rng: random.Random) -> None:
        self.sql = sql
        self.rng = rng
        self.paused: dict[str, bool] = dict.fromkeys(QUEUES, False)
        self.changes: Counter[str] = Counter()
        self._set("limited", max_running=2)
        self._set("rated", rate=(5, 1.0))
        self._set("keyed", max_running_per_key=1)
        self._set("default", max_running=None)

    def _set(self, queue: str, **settings: Any) -> None:
        self.sql.retrying(
            lambda: self.sql._run(lambda c: aioq.admin.set_queue(c, queue, **settings))
        )

    def toggle(self) -> None:
        """Pause or resume a queue, or change its limit."""
        queue = self.rng.choice(QUEUES)
        if queue == "default" or self.rng.random() < 0.4:
            self.paused[queue] = not self.paused[queue]
            self._set(queue, paused=self.paused[queue])
            self.changes["resume" if not self.paused[queue] else "pause"] += 1
        elif queue == "limited":
            self._set(queue, max_running=self.rng.choice([None, 1, 2, 4]))
            self.changes["max_running"] += 1
        elif queue == "rated":
            self._set(queue, rate=self.rng.choice([None, (2, 1.0), (5, 1.0), (1, 0.5)]))
            self.changes["rate"] += 1
        else:
            self._set(queue, max_running_per_key=self.rng.choice([None, 1, 2]))
            self.changes["max_running_per_key"] += 1

    def lift(self) -> None:
        """Resume every queue and lift the limits: the drain must not wait on them."""
        for queue in QUEUES:
            self._set(queue, paused=False, max_running=None, rate=None, max_running_per_key=None)


def _left_running(sql: Sql, pid: int, faults: list[Fault]) -> list[str]:
    """A worker that stopped gracefully (not killed) must leave no row ``running``.

    Unless the network failed while it stopped: then its release may not have reached the
    database, and the rows wait for their leases to expire (another worker reaps them).
    """
    if any(f.kind == "kill" and f.pid == pid for f in faults):
        return []
    stop = next((f for f in faults if f.kind in ("stop", "cancel") and f.pid == pid), None)
    since = stop.started if stop is not None else time.time() - GRACE - SLACK
    if _net_fault_between(faults, since - 1.0, time.time()):
        return []
    rows = sql.retrying(
        lambda: sql.fetch(
            "SELECT id, attempts FROM aioq.jobs WHERE status = 'running'"
            " AND split_part(locked_by, ':', 2) = $1",
            str(pid),
        )
    )
    return [
        f"job {r['id']} (attempt {r['attempts']}) left running by worker pid {pid},"
        " which stopped gracefully"
        for r in rows
    ]


def _drain(sql: Sql, fleet: Workers, rng: random.Random, faults: list[Fault]) -> list[str]:
    """Let healthy workers finish every job, then stop them all gracefully."""
    violations: list[str] = []
    guard = time.monotonic() + DRAIN_GUARD
    left = -1
    while time.monotonic() < guard:
        for pid in fleet.reap(time.time(), rng):
            violations += _left_running(sql, pid, faults)
        left = sql.retrying(
            lambda: sql.value(
                "SELECT count(*) FROM aioq.jobs WHERE status IN ('waiting', 'pending', 'running')"
            )
        )
        if left == 0:
            break
        time.sleep(0.2)
    else:
        rows = sql.fetch(
            "SELECT id, task, status, attempts, locked_by, lease_expires_at, run_at"
            " FROM aioq.jobs WHERE status IN ('waiting', 'pending', 'running') ORDER BY id LIMIT 10"
        )
        violations.append(
            f"{left} jobs still waiting, pending or running after {DRAIN_GUARD:g}s without faults:"
            f" {[dict(r) for r in rows]}"
        )
    for slot in fleet.alive():
        assert slot.proc is not None
        slot.proc.send_signal(signal.SIGTERM)
    for slot in fleet.slots:
        if slot.proc is not None:
            try:
                slot.proc.wait(60)
            except subprocess.TimeoutExpired:
                violations.append(f"worker pid {slot.proc.pid} ignored SIGTERM for 60s")
                slot.proc.kill()
                slot.proc.wait(30)
            slot.exits[slot.proc.pid] = time.time()
            violations += _left_running(sql, slot.proc.pid, faults)
            slot.proc = None
    running = sql.fetch("SELECT id, locked_by FROM aioq.jobs WHERE status = 'running'")
    if running:
        violations.append(f"rows running once every worker stopped: {[dict(r) for r in running]}")
    return violations


def _collect(sql: Sql, fleet: Workers) -> tuple[list[dict[str, Any]], dict[int, float]]:
    rows = sql.fetch(
        "SELECT id, job_id, attempt, pid, kind, started_at, ended_at, outcome FROM runs ORDER BY id"
    )
    runs = [
        {
            "id": r["id"],
            "job_id": r["job_id"],
            "attempt": r["attempt"],
            "pid": r["pid"],
            "kind": r["kind"],
            "started": _epoch(r["started_at"]),
            "ended": _epoch(r["ended_at"]),
            "outcome": r["outcome"],
        }
        for r in rows
    ]
    exits = {pid: at for slot in fleet.slots for pid, at in slot.exits.items()}
    return runs, exits


def _terminal(sql: Sql, job_ids: list[int]) -> list[str]:
    """Every job is archived once or dead, never both, never neither."""
    archived = Counter(r["id"] for r in sql.fetch("SELECT id FROM aioq.archive"))
    dead = {r["id"] for r in sql.fetch("SELECT id FROM aioq.jobs WHERE status = 'dead'")}
    violations = [f"job {j} archived {n} times" for j, n in archived.items() if n > 1]
    violations += [f"job {j} both archived and dead" for j in set(archived) & dead]
    missing = set(job_ids) - set(archived) - dead
    if missing:
        violations.append(f"{len(missing)} jobs in no terminal state: {sorted(missing)[:20]}")
    return violations


def _run(
    run_id: int,
    pid: int,
    started: float,
    ended: float | None,
    outcome: str | None,
    *,
    job_id: int = 1,
    kind: str = "async",
) -> dict[str, Any]:
    return {
        "id": run_id,
        "job_id": job_id,
        "attempt": run_id,
        "pid": pid,
        "kind": kind,
        "started": started,
        "ended": ended,
        "outcome": outcome,
    }


def test_the_analysis_tells_explained_from_unexplained_runs() -> None:
    """The checker itself: each rule flags what it should and excuses only what a fault explains."""
    lease = {1: 2.0}
    # Planned snooze, then a run: no duplicate, no overlap.
    planned = [_run(1, 10, 100.0, 100.5, "snooze"), _run(2, 11, 101.0, 102.0, "ok")]
    assert analyse(planned, [], {}, lease) == ([], {})
    # One worker runs the job twice at once: never explained, whatever the faults.
    same = [_run(1, 10, 100.0, 103.0, "ok"), _run(2, 10, 102.0, 104.0, "ok")]
    found, figures = analyse(same, [Fault("drop", 101.0, 101.0)], {}, lease)
    assert len(found) == 1
    assert "on the same worker" in found[0]
    assert figures["overlaps"] == 1
    # Two workers at once, no fault: the lease expired on a healthy worker.
    healthy = [_run(1, 10, 100.0, 103.0, "ok"), _run(2, 11, 102.0, 104.0, "ok")]
    found, _ = analyse(healthy, [], {}, lease)
    assert any("no network fault" in v for v in found)
    assert any("no fault to explain it" in v for v in found)
    # The same with a stall of the network during the first run: explained (the rerun's id
    # is what the workflow checks excuse a fan-in's second success with).
    explained: set[int] = set()
    found, figures = analyse(healthy, [Fault("stall", 100.5, 101.5)], {}, lease, explained)
    assert found == []
    assert explained == {2}
    assert figures == {"overlaps": 1, "overlaps_explained": 1, "duplicates": 1, "duplicates_network": 1}  # fmt: skip
    # A run cut by SIGKILL (no end recorded) ends at the kill; its rerun is explained by it.
    killed = [_run(1, 10, 100.0, None, None), _run(2, 11, 104.0, 105.0, "ok")]
    found, figures = analyse(killed, [Fault("kill", 101.0, 101.0, pid=10)], {}, lease)
    assert found == []
    assert figures == {"duplicates": 1, "duplicates_killed": 1}
    # A run whose end is unknown and whose worker was never killed overlaps everything after.
    found, _ = analyse(killed, [], {}, lease)
    assert len(found) == 2
    # Worker 10's loop was blocked (by job 2's run) during the first run: it could extend no
    # lease, so worker 11's run beside it is explained; the block is 10's, not 11's.
    block = _run(9, 10, 100.5, 101.8, "ok", job_id=2, kind="block")
    leases = {1: 2.0, 2: 1.0}
    found, figures = analyse([*healthy, block], [], {}, leases)
    assert found == []
    assert figures["overlaps_blocked"] == 1
    assert figures["duplicates_blocked"] == 1
    # The same block does not excuse worker 10 starting a job worker 11 runs, nor two runs at
    # once on the blocked worker itself.
    late = [_run(1, 11, 100.0, 103.0, "ok"), _run(2, 10, 102.0, 104.0, "ok")]
    found, _ = analyse([*late, block], [], {}, leases)
    assert any("no network fault or blocked loop" in v for v in found)
    found, _ = analyse([*same, block], [], {}, leases)
    assert any("on the same worker" in v for v in found)
    # A hard cancel excuses the rerun of a cancelled run, never that of a run that ended (a
    # thread's run keeps its claim and its outcome is written).
    cancel = [Fault("cancel", 100.5, 101.0, pid=10)]
    cut = [_run(1, 10, 100.0, 100.6, "cancelled"), _run(2, 11, 101.0, 102.0, "ok")]
    assert analyse(cut, cancel, {}, lease) == ([], {"duplicates": 1, "duplicates_stopped": 1})
    ended = [_run(1, 10, 100.0, 100.6, "ok"), _run(2, 11, 101.0, 102.0, "ok")]
    found, _ = analyse(ended, cancel, {}, lease)
    assert any("no fault to explain it" in v for v in found)


def test_the_flow_analysis_tells_order_fan_in_and_losses() -> None:
    """The workflow checks: a step started before a dependency succeeded, a fan-in that
    succeeded twice with no fault to explain it, a lost step and a disagreeing aioq.workflow()
    are each flagged; the same runs in order pass."""
    flow = Flow(
        7,
        "diamond",
        {"top": 1, "left": 2, "right": 3, "bottom": 4},
        {"top": [], "left": ["top"], "right": ["top"], "bottom": ["left", "right"]},
        {"top": "cancel", "left": "cancel", "right": "run", "bottom": "cancel"},
    )
    steps = [
        aioq.admin.WorkflowStep(
            name=n, job_id=j, task="work", queue=None, status="succeeded",
            after=flow.after[n], on_failure=flow.on_failure[n], attempts=1, last_error=None,
        )
        for n, j in flow.jobs.items()
    ]  # fmt: skip
    info = aioq.admin.WorkflowInfo(
        id=7,
        name="chaos-diamond",
        state="succeeded",
        created_at=datetime.now(),
        counts={"succeeded": 4},
        steps=steps,
    )
    good = [
        _run(1, 10, 100.0, 100.5, "ok", job_id=1),
        _run(2, 11, 100.6, 100.9, "snooze", job_id=2),
        _run(3, 11, 101.0, 101.5, "ok", job_id=2),
        _run(4, 10, 100.7, 101.2, "ok", job_id=3),
        _run(5, 12, 101.6, 102.0, "ok", job_id=4),
    ]
    found, figures = analyse_flows([flow], {7: info}, good, set())
    assert found == []
    assert figures["fan_ins"] == 1
    assert figures["steps"] == 4
    # The fan-in starts after "right" succeeded but before "left" did: an order violation.
    early = [*good[:4], _run(5, 12, 101.3, 102.0, "ok", job_id=4)]
    found, _ = analyse_flows([flow], {7: info}, early, set())
    assert len(found) == 1
    assert "before its dependency 'left' succeeded" in found[0]
    # A step run while its dependency only snoozed: it never succeeded.
    found, _ = analyse_flows([flow], {7: info}, [good[1], good[4]], set())
    assert any("'left' never succeeded" in v for v in found)
    assert any("step 'top' (job 1) never succeeded (lost)" in v for v in found)
    # The fan-in succeeds twice: flagged unless analyse() explained the second run.
    twice = [*good, _run(6, 10, 102.5, 102.8, "ok", job_id=4)]
    found, _ = analyse_flows([flow], {7: info}, twice, set())
    assert len(found) == 1
    assert "fan-in step 'bottom'" in found[0]
    found, figures = analyse_flows([flow], {7: info}, twice, {6})
    assert found == []
    assert figures["fan_in_reruns_explained"] == 1
    # aioq.workflow() must agree: the run, its state and every step as deferred.
    found, _ = analyse_flows([flow], {}, good, set())
    assert found == ["workflow 7 (diamond): aioq.workflow() finds no such run"]
    waiting = [*steps[:3], dataclasses.replace(steps[3], status="waiting")]
    stuck = dataclasses.replace(info, state="running", counts={"succeeded": 3, "waiting": 1}, steps=waiting)  # fmt: skip
    found, _ = analyse_flows([flow], {7: stuck}, good, set())
    assert len(found) == 2
