"""Workflows: steps with dependencies, deferred together in the caller's transaction.

docs/architecture.md, "Workflows". A step is a job that waits (status ``waiting``, not
claimable) until its dependencies succeeded; the statement that records a dependency's success
makes it pending when it was the last one missing, so the fan-in happens once, decided by no
poller. A dependency that ends dead or cancelled cancels its dependents (transitively), unless
they were added with ``on_failure="run"``; replaying it brings them back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from aioq import hooks
from aioq.codec import decode_result
from aioq.db import Target, executor
from aioq.dbapi import SyncTarget
from aioq.dbapi import executor as sync_executor
from aioq.errors import ConfigError
from aioq.job import possible_id
from aioq.options import check_name
from aioq.registry import Registry
from aioq.sql import DEFAULT_SCHEMA
from aioq.sql import workflows as sql
from aioq.tasks import Call

__all__ = (
    "ON_FAILURE",
    "Step",
    "Workflow",
    "WorkflowInfo",
    "WorkflowRun",
    "WorkflowStep",
    "chain",
    "group",
    "list_workflows",
    "list_workflows_sync",
    "workflow",
    "workflow_sync",
)

ON_FAILURE = ("cancel", "run")
"""What a step does when a dependency ends dead or cancelled: be cancelled, or run anyway."""

_NO_HOOK = contextlib.nullcontext()

MAX_NAME = 200
"""The longest workflow or step name, in characters."""


@dataclass(frozen=True, slots=True, eq=False)
class Step:
    """A step added to a :class:`Workflow`: what ``after=`` takes."""

    flow: Workflow = field(repr=False)
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class _Planned:
    call: Call
    name: str
    after: tuple[int, ...]
    on_failure: str


@dataclass(frozen=True, slots=True)
class WorkflowRun:
    """A deferred run: its id and its steps' job ids by step name."""

    id: int
    name: str
    jobs: dict[str, int]


class Workflow:
    """Steps and their dependencies, deferred together by :meth:`defer`."""

    def __init__(self, name: str) -> None:
        self.name = check_name("name", name, MAX_NAME)
        self._steps: list[_Planned] = []
        self._names: set[str] = set()
        self._counts: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<aioq.Workflow {self.name!r} steps={len(self._steps)}>"

    def __len__(self) -> int:
        return len(self._steps)

    def add(
        self,
        call: Call,
        *,
        after: Iterable[Step] = (),
        name: str | None = None,
        on_failure: str = "cancel",
    ) -> Step:
        """Add a step that runs once every step of ``after`` succeeded; return it.

        ``name`` is unique within the run (by default the task's name, numbered from its second
        use); ``on_failure="run"`` runs the step even if a dependency ends dead or cancelled.
        """
        if not isinstance(call, Call):
            raise ConfigError("call", f"must be a task's .call(...), got {call!r}")
        if on_failure not in ON_FAILURE:
            raise ConfigError("on_failure", f"must be 'cancel' or 'run', got {on_failure!r}")
        if isinstance(after, Step):
            after = (after,)
        parents: dict[int, None] = {}  # in order, once each
        for step in after:
            if not isinstance(step, Step):
                raise ConfigError("after", f"must be steps this workflow returned, got {step!r}")
            if step.flow is not self:
                raise ConfigError(
                    "after",
                    f"step {step.name!r} belongs to another workflow ({step.flow.name!r}): after="
                    " takes the steps this workflow's add() returned",
                )
            parents[step.index] = None
        if name is None:
            base = call.task.name.rpartition(".")[2]
            used = self._counts.get(base, 0)  # "load", then "load-2", "load-3"...
            name = f"{base}-{used + 1}" if used else base
            while name in self._names:
                used += 1
                name = f"{base}-{used + 1}"
            self._counts[base] = used + 1
        else:
            check_name("name", name, MAX_NAME)
            if name in self._names:
                raise ConfigError("name", f"step name {name!r} is already used in this workflow")
        if self._steps and call.task.registry.schema != self._steps[0].call.task.registry.schema:
            raise ConfigError("call", "every step's task must live in the same schema")
        self._names.add(name)
        self._steps.append(_Planned(call, name, tuple(parents), on_failure))
        return Step(self, len(self._steps) - 1, name)

    async def defer(self, conn: Target, /) -> WorkflowRun:
        """Enqueue every step inside the caller's transaction; return the run.

        Two round trips: one takes the steps' job ids, then one statement writes the run and
        all its steps, so the run is written whole or not at all whatever the connection's
        state: inside the caller's transaction (rolled back: no step, no run; it never
        commits), or on a connection in autocommit or a pool, where it commits on its own.
        """
        if not self._steps:
            raise ConfigError("steps", f"workflow {self.name!r} has no step")
        db = await executor(conn)
        schema = self._steps[0].call.task.registry.schema
        deferral = self._deferral()
        with hooks.deferring(deferral) if hooks.observers else _NO_HOOK:
            ids = await sql.NEW_JOB_IDS.row(db, schema, len(self._steps))
            assert ids is not None  # a SELECT without FROM returns its row
            run_id = await sql.INSERT_WORKFLOW.row(db, schema, self._insert(ids, deferral))
            assert run_id is not None  # an INSERT ... RETURNING returns its row
            deferral.ids = ids
        return self._run(run_id, ids)

    def defer_sync(self, conn: SyncTarget, /) -> WorkflowRun:
        """Enqueue every step from synchronous code, inside the transaction of ``conn``
        (psycopg, Django's connection, a SQLAlchemy Session or Connection), as :meth:`defer`:
        one statement writes the run, so it is whole also on a connection in autocommit."""
        if not self._steps:
            raise ConfigError("steps", f"workflow {self.name!r} has no step")
        schema = self._steps[0].call.task.registry.schema
        db = sync_executor(conn)
        deferral = self._deferral()
        with hooks.deferring(deferral) if hooks.observers else _NO_HOOK:
            ids = sql.NEW_JOB_IDS.row_sync(db, schema, len(self._steps))
            assert ids is not None  # a SELECT without FROM returns its row
            run_id = sql.INSERT_WORKFLOW.row_sync(db, schema, self._insert(ids, deferral))
            assert run_id is not None  # an INSERT ... RETURNING returns its row
            deferral.ids = ids
        return self._run(run_id, ids)

    def _deferral(self) -> hooks.Deferral:
        """The run's defer as observers see it (one span for the run, tracing every step)."""
        first = self._steps[0].call
        return hooks.Deferral(f"workflow {self.name}", first.opts.queue, len(self._steps))

    def _insert(self, ids: list[int], deferral: hooks.Deferral) -> sql.InsertWorkflow:
        """INSERT_WORKFLOW's values: the run, its steps in order (with their job ids), the
        edges between them."""
        steps = self._steps
        return sql.InsertWorkflow(
            name=self.name,
            ids=ids,
            queues=[s.call.opts.queue for s in steps],
            tasks=[s.call.task.name for s in steps],
            args=[s.call.args for s in steps],
            priorities=[s.call.opts.priority for s in steps],
            run_ats=[s.call.opts.run_at for s in steps],
            delays=[s.call.opts.delay for s in steps],
            max_attempts=[s.call.opts.max_attempts for s in steps],
            leases=[s.call.opts.lease for s in steps],
            concurrency_keys=[s.call.concurrency_key for s in steps],
            names=[s.name for s in steps],
            remaining=[len(s.after) for s in steps],
            on_failure=[s.on_failure for s in steps],
            edge_steps=[ids[n] for n, s in enumerate(steps) for _ in s.after],
            edge_parents=[ids[parent] for s in steps for parent in s.after],
            traceparent=deferral.traceparent,
        )

    def _run(self, run_id: int, ids: list[int]) -> WorkflowRun:
        jobs = {s.name: ids[i] for i, s in enumerate(self._steps)}
        return WorkflowRun(run_id, self.name, jobs)


def chain(*calls: Call, name: str = "chain") -> Workflow:
    """A workflow whose steps each run after the previous one succeeded."""
    flow = Workflow(name)
    previous: list[Step] = []
    for call in calls:
        previous = [flow.add(call, after=previous)]
    return flow


def group(*calls: Call, then: Call | None = None, name: str = "group") -> Workflow:
    """A workflow of steps that run in parallel, and ``then`` once they all succeeded."""
    flow = Workflow(name)
    steps = [flow.add(call) for call in calls]
    if then is not None:
        flow.add(then, after=steps)
    return flow


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowStep:
    """One step of a run as stored: its job, status and dependencies (by step name)."""

    name: str
    job_id: int
    task: str
    queue: str | None  # None once its job row left the table
    status: str  # waiting, pending, running, succeeded, dead, cancelled (deleted: gone)
    after: list[str]
    on_failure: str
    attempts: int | None
    last_error: str | None
    result: Any = None  # the step's return value, once it succeeded


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowInfo:
    """A run: its name, its state, and its steps in the order they were added.

    ``state``: ``running`` while any step may still run; then ``succeeded`` when every step
    did, ``failed`` when a step is dead (or ended without succeeding and its job was deleted
    since, as ``aioq jobs purge`` does), else ``cancelled``.
    """

    id: int
    name: str
    state: str
    created_at: datetime
    counts: dict[str, int]  # steps by status
    steps: list[WorkflowStep] = field(default_factory=list)
    # list_workflows counts the steps still in the jobs table (every status but succeeded, which
    # is exact) up to this: a count above it means "more". None: every count is exact.
    count_limit: int | None = None

    def count_text(self, status: str) -> str:
        """A status's count as shown: ``10000+`` past what was counted."""
        n = self.counts[status]
        limit = self.count_limit
        if limit is None or status == "succeeded" or n <= limit:  # succeeded: always exact
            return str(n)
        return f"{limit}+"


LIST_COUNT_LIMIT = 10_000
"""The most steps per status that :func:`list_workflows` counts in a run (then "10000+"), but
succeeded ones (the run keeps their count): a list of huge runs stays cheap; :func:`workflow`
counts them all."""


def _state(row: sql.WorkflowRow, limit: int | None = None) -> str:
    if row.waiting or row.pending or row.running:
        return "running"
    in_jobs = (row.waiting, row.pending, row.running, row.dead, row.cancelled)
    exact = limit is None or max(in_jobs) <= limit
    if row.dead or (exact and row.succeeded + row.cancelled < row.steps):
        # A step ended dead or cancelled and its job was deleted since (`aioq jobs purge`,
        # dead_retention, delete_jobs): counted nowhere, and the run did not succeed. (Past
        # the count limit such a step goes unseen: the list may call that run succeeded or
        # cancelled; its own page, which counts every step, says failed.)
        return "failed"
    if row.cancelled:
        return "cancelled"
    return "succeeded"


def _counts(row: sql.WorkflowRow) -> dict[str, int]:
    names = ("waiting", "pending", "running", "succeeded", "dead", "cancelled")
    return {n: getattr(row, n) for n in names}


async def workflow(
    conn: Target,
    workflow_id: int,
    /,
    *,
    schema: str = DEFAULT_SCHEMA,
    registry: Registry | None = None,
) -> WorkflowInfo | None:
    """Return a run with every step's name, job id, status and result; None if there is none
    (an id outside bigint names no run: None, without asking the database).

    With a ``registry``, the result of a step whose task it has is read as that task's return
    annotation (a dataclass, a datetime...); the others, and every result without one, are the
    JSON as stored.
    """
    if not possible_id(workflow_id):
        return None
    db = await executor(conn)
    row = await sql.GET_WORKFLOW.row(db, schema, workflow_id)
    if row is None:
        return None
    return _run(row, await sql.WORKFLOW_STEPS.rows(db, schema, workflow_id), registry)


def workflow_sync(
    conn: SyncTarget,
    workflow_id: int,
    /,
    *,
    schema: str = DEFAULT_SCHEMA,
    registry: Registry | None = None,
) -> WorkflowInfo | None:
    """Return a run, as :func:`workflow` does, from synchronous code."""
    if not possible_id(workflow_id):
        return None
    db = sync_executor(conn)
    row = sql.GET_WORKFLOW.row_sync(db, schema, workflow_id)
    if row is None:
        return None
    return _run(row, sql.WORKFLOW_STEPS.rows_sync(db, schema, workflow_id), registry)


def _step_result(step: sql.StepRow, registry: Registry | None) -> Any:
    """A step's stored result, read as its task's return annotation when ``registry`` has it."""
    if step.result is None:
        return None
    value = decode_result(step.result)
    task = None if registry is None else registry.get(step.task)
    return value if task is None else task.codec.decode_result(value, step.job_id)


def _run(
    row: sql.WorkflowRow, step_rows: list[sql.StepRow], registry: Registry | None = None
) -> WorkflowInfo:
    steps = [
        WorkflowStep(
            name=s.name,
            job_id=s.job_id,
            task=s.task,
            queue=s.queue,
            status=s.status,
            after=s.after,
            on_failure=s.on_failure,
            attempts=s.attempts,
            last_error=s.last_error,
            result=_step_result(s, registry),
        )
        for s in step_rows
    ]
    return WorkflowInfo(
        id=row.id,
        name=row.name,
        state=_state(row),
        created_at=row.created_at,
        counts=_counts(row),
        steps=steps,
    )


async def list_workflows(
    conn: Target, *, name: str | None = None, limit: int = 50, schema: str = DEFAULT_SCHEMA
) -> list[WorkflowInfo]:
    """Return the newest runs first (without their steps), optionally of one name.

    Each run's steps still in the jobs table are counted per status up to
    :data:`LIST_COUNT_LIMIT` (``count_limit``; a count above it means more), and its succeeded
    steps exactly, so the list stays cheap however large the runs."""
    db = await executor(conn)
    bound = LIST_COUNT_LIMIT
    return _runs(await sql.LIST_WORKFLOWS.rows(db, schema, limit, name, bound), bound)


def list_workflows_sync(
    conn: SyncTarget, *, name: str | None = None, limit: int = 50, schema: str = DEFAULT_SCHEMA
) -> list[WorkflowInfo]:
    """Return the newest runs first, as :func:`list_workflows` does, from synchronous code."""
    db = sync_executor(conn)
    bound = LIST_COUNT_LIMIT
    return _runs(sql.LIST_WORKFLOWS.rows_sync(db, schema, limit, name, bound), bound)


def _runs(rows: list[sql.WorkflowRow], bound: int) -> list[WorkflowInfo]:
    return [
        WorkflowInfo(
            id=r.id,
            name=r.name,
            state=_state(r, bound),
            created_at=r.created_at,
            counts=_counts(r),
            count_limit=bound,
        )
        for r in rows
    ]
