"""The job's state machine is one table (aioq.states.TRANSITIONS), and the SQL keeps to it.

Every statement that writes ``jobs.status`` runs here on a real database against rows in each
status it may meet; a logging trigger records every change of status it makes (inserts and
deletes too), and the triggers' own changes apart (their depth). Each change must be a
transition of the table for the event the statement performs on that row, and each transition
of the table must be made by some statement: none is dead. Which statements write a status is
read from their text, so a new one cannot go unlisted (docs/architecture.md, "Job states").
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from golden import all_statements

import aioq
from aioq.sql import DEFAULT_SCHEMA as S
from aioq.sql import control_channel, results_channel, schedules, workflows
from aioq.sql import jobs as j
from aioq.sql.admin import DELETE_JOBS, REPLAY
from aioq.sql.control import CANCEL_JOBS
from aioq.sql.limits import CLAIM_LIMITED, LOCK_QUEUE
from aioq.sql.maintenance import PRUNE_ENDED
from aioq.sql.outcomes import (
    COMPLETE,
    RELEASE_WORKER,
    RESCUE_EXPIRED,
    WRITE_OUTCOMES,
    WRITE_STEP_OUTCOMES,
    WriteOutcomes,
)
from aioq.states import TRANSITIONS, Event, JobStatus, OutcomeKind, Transition, mermaid, table

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = {Event(kind.value) for kind in OutcomeKind}

# Every statement that writes a job's status, and the events it performs (on the rows it
# changes itself; the triggers' changes are TRIGGERS').
STATEMENTS: dict[str, set[Event]] = {
    "sql.jobs.INSERT_DEFAULT_JOB": {Event.DEFERRED},
    "sql.jobs.INSERT_JOB": {Event.DEFERRED},
    "sql.jobs.INSERT_UNIQUE_JOB": {Event.DEFERRED},
    "sql.jobs.INSERT_JOBS": {Event.DEFERRED},
    "sql.jobs.INSERT_KEYED_JOB": {Event.DEFERRED},
    "sql.jobs.INSERT_KEYED_JOBS": {Event.DEFERRED},
    "sql.jobs.INSERT_UNIQUE_JOB_FOR": {Event.DEFERRED},
    "sql.schedules.SCHEDULE_TICK": {Event.DEFERRED},
    "sql.workflows.INSERT_WORKFLOW": {Event.DEFERRED},
    "sql.jobs.CLAIM_ONE_QUEUE": {Event.CLAIM},
    "sql.jobs.CLAIM_QUEUES": {Event.CLAIM},
    "sql.limits.CLAIM_LIMITED": {Event.CLAIM},
    "sql.outcomes.COMPLETE": {Event.SUCCEEDED},
    "sql.outcomes.WRITE_OUTCOMES": OUTCOMES,
    "sql.outcomes.WRITE_STEP_OUTCOMES": OUTCOMES | {Event.DEPENDENCIES_MET},
    "sql.outcomes.RELEASE_WORKER": {Event.RELEASED},
    "sql.outcomes.RESCUE_EXPIRED": {Event.RESCUED},
    "sql.control.CANCEL_JOBS": {Event.CANCEL},
    "sql.admin.REPLAY": {Event.REPLAY},
    "sql.admin.DELETE_JOBS": {Event.DELETED},
    "sql.maintenance.PRUNE_ENDED": {Event.PRUNED},
}

# The triggers on jobs that write a status (schema.sql), and the events they perform: a step
# that ends dead or cancelled cancels the waiting steps that need it and releases those that
# run anyway; a replayed one revives the steps it cancelled. The BEFORE trigger that makes a
# replayed step wait changes the replay's own row: its change is REPLAY's.
TRIGGERS: dict[str, set[Event]] = {
    "jobs_workflow_step_changed": {
        Event.DEPENDENCY_FAILED,
        Event.DEPENDENCIES_MET,
        Event.DEPENDENCY_REPLAYED,
    },
    "jobs_workflow_step_replayed": {Event.REPLAY},
}
TRIGGER_EVENTS = TRIGGERS["jobs_workflow_step_changed"]  # what changes rows of its own

LOG = """
CREATE TABLE public.status_log (n serial, id bigint, old text, new text, depth integer);
CREATE FUNCTION public.log_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO public.status_log (id, old, new, depth)
        VALUES (NEW.id, NULL, NEW.status, pg_trigger_depth());
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO public.status_log (id, old, new, depth)
        VALUES (OLD.id, OLD.status, NULL, pg_trigger_depth());
    ELSIF OLD.status IS DISTINCT FROM NEW.status THEN
        INSERT INTO public.status_log (id, old, new, depth)
        VALUES (NEW.id, OLD.status, NEW.status, pg_trigger_depth());
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER zz_log_status AFTER INSERT OR UPDATE OR DELETE ON aioq.jobs
    FOR EACH ROW EXECUTE FUNCTION public.log_status();
"""


@dataclass
class Machine:
    """Runs statements and holds each change of status they make against the table."""

    conn: asyncpg.Connection
    seen: dict[Transition, set[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    ran: dict[str, int] = field(default_factory=dict)

    async def run(
        self, name: str, call: Callable[[], Awaitable[Any]], rows: dict[int, Event] | None = None
    ) -> None:
        """Run statement ``name`` (through ``call``); ``rows``: the event it performs on each of
        these rows (an outcome per job), else any of the statement's events."""
        allowed = STATEMENTS[name]
        assert rows is None or set(rows.values()) <= allowed, name
        await self.conn.execute("TRUNCATE public.status_log")
        await call()
        changes = await self.conn.fetch(
            "SELECT id, old, new, depth FROM public.status_log ORDER BY n"
        )
        self.ran[name] = self.ran.get(name, 0) + sum(1 for c in changes if c["depth"] == 1)
        for change in changes:
            by = name if change["depth"] == 1 else "a trigger"
            if change["depth"] > 1:
                events = TRIGGER_EVENTS
            elif rows is not None and change["id"] in rows:
                events = {rows[change["id"]]}
            else:
                events = allowed
            old = None if change["old"] is None else JobStatus(change["old"])
            new = None if change["new"] is None else JobStatus(change["new"])
            found = [
                t
                for t in TRANSITIONS
                if t.event in events
                and t.source == old
                and (t.target == new or (new is None and t.target is JobStatus.SUCCEEDED))
            ]
            if len(found) != 1:
                self.problems.append(
                    f"{by} (in {name}) took job {change['id']} from {old} to {new}:"
                    f" {'no' if not found else 'more than one'} transition of the table for"
                    f" {sorted(events)}"
                )
            for t in found:
                self.seen.setdefault(t, set()).add(by if by != "a trigger" else f"{name} (trigger)")


async def job(
    conn: asyncpg.Connection,
    status: str,
    *,
    queue: str = "q",
    attempts: int = 1,
    max_attempts: int = 5,
    cancel_requested: bool = False,
    worker: str = "w",
    expired: bool = False,
    old: bool = False,
    key: str | None = None,
) -> int:
    """A job row in ``status`` (running: held by ``worker``, claim 1)."""
    running = status == "running"
    return int(
        await conn.fetchval(
            """
            INSERT INTO aioq.jobs (queue, task, args, status, attempts, max_attempts, claims,
                                   locked_by, locked_at, lease_expires_at, cancel_requested_at,
                                   run_at, concurrency_key)
            VALUES ($1, 't', '{}', $2, $3, $4, 1, CASE WHEN $5 THEN $6 END,
                    CASE WHEN $5 THEN now() END,
                    CASE WHEN $5 THEN now() + CASE WHEN $7 THEN interval '-1 s'
                                                   ELSE interval '30 s' END END,
                    CASE WHEN $8 THEN now() END,
                    now() - CASE WHEN $9 THEN interval '30 days' ELSE interval '1 s' END, $10)
            RETURNING id
            """,
            queue,
            status,
            attempts,
            max_attempts,
            running,
            worker,
            expired,
            cancel_requested,
            old,
            key,
        )
    )


async def every_status(conn: asyncpg.Connection, queue: str = "q", **options: Any) -> list[int]:
    """One job in each status a jobs row can have (running ones held by worker w)."""
    return [
        await job(conn, s, queue=queue, **options)
        for s in ("pending", "running", "dead", "cancelled", "waiting")
    ]


async def hold(conn: asyncpg.Connection, job_id: int, worker: str = "w") -> tuple[int, int]:
    """Make a job running under a new claim of ``worker``, as a claim does; its claim key."""
    number = await conn.fetchval(
        "UPDATE aioq.jobs SET status = 'running', locked_by = $2, claims = claims + 1,"
        " attempts = attempts + 1, locked_at = now(), lease_expires_at = now() + lease"
        " WHERE id = $1 RETURNING claims",
        job_id,
        worker,
    )
    return job_id, int(number)


def outcomes(keys: Sequence[tuple[int, int]], kinds: Sequence[str]) -> WriteOutcomes:
    n = len(keys)
    return WriteOutcomes(
        ids=[k[0] for k in keys],
        claims=[k[1] for k in keys],
        worker="w",
        kinds=list(kinds),
        delays=[0.0] * n,
        errors=["boom"] * n,
        results=[None] * n,
        ttls=[None] * n,
        archive=False,
        results_channel=results_channel(S),
    )


def insert(**more: Any) -> dict[str, Any]:
    values = {
        "queue": "q",
        "task": "t",
        "args": "{}",
        "priority": 0,
        "run_at": None,
        "delay": 0.0,
        "max_attempts": 5,
        "lease": 30.0,
        "traceparent": None,
    }
    return values | more


async def defer_everything(m: Machine, registry: aioq.Registry) -> None:
    conn = m.conn
    await m.run(
        "sql.jobs.INSERT_DEFAULT_JOB", lambda: j.INSERT_DEFAULT_JOB.row(conn, S, "q", "t", "{}")
    )
    await m.run("sql.jobs.INSERT_JOB", lambda: j.INSERT_JOB.row(conn, S, j.InsertJob(**insert())))
    unique = j.InsertUniqueJob(**insert(unique_key="u1"))
    await m.run("sql.jobs.INSERT_UNIQUE_JOB", lambda: j.INSERT_UNIQUE_JOB.row(conn, S, unique))
    many = {k: v for k, v in insert().items() if k != "args"}
    await m.run(
        "sql.jobs.INSERT_JOBS",
        lambda: j.INSERT_JOBS.rows(conn, S, j.InsertJobs(**many, args=["{}", "{}"])),
    )
    keyed = j.InsertKeyedJob(**insert(concurrency_key="k"))
    await m.run("sql.jobs.INSERT_KEYED_JOB", lambda: j.INSERT_KEYED_JOB.row(conn, S, keyed))
    keyed_many = j.InsertKeyedJobs(**many, args=["{}"], concurrency_keys=["k"])
    await m.run("sql.jobs.INSERT_KEYED_JOBS", lambda: j.INSERT_KEYED_JOBS.rows(conn, S, keyed_many))
    window = j.InsertUniqueJobFor(
        **insert(unique_key="u2"), unique_for=60.0, replace=False, concurrency_key=None
    )
    await m.run(
        "sql.jobs.INSERT_UNIQUE_JOB_FOR", lambda: j.INSERT_UNIQUE_JOB_FOR.row(conn, S, window)
    )
    now = await conn.fetchval("SELECT now()")
    spec = {"name": "every", "task": "t", "queue": "q", "spec": "every 60s"}
    start = schedules.ScheduleStart(**spec, last_tick=now - timedelta(hours=1), next_tick=now)
    await schedules.SCHEDULE_START.row(conn, S, start)
    tick = schedules.ScheduleTick(
        **spec, ticks=[now], next_tick=now + timedelta(minutes=1), args="{}", priority=0,
        max_attempts=5, lease=30.0,
    )  # fmt: skip
    await m.run("sql.schedules.SCHEDULE_TICK", lambda: schedules.SCHEDULE_TICK.rows(conn, S, tick))

    ids = await workflows.NEW_JOB_IDS.row(conn, S, 2)
    assert ids is not None
    run = workflows.InsertWorkflow(
        name="flow", ids=ids, queues=["q", "q"], tasks=["s", "s"], args=["{}", "{}"], priorities=[0, 0],
        run_ats=[None, None], delays=[0.0, 0.0], max_attempts=[5, 5], leases=[30.0, 30.0],
        concurrency_keys=[None, None], names=["a", "b"], remaining=[0, 1],
        on_failure=["cancel", "cancel"], edge_steps=[ids[1]], edge_parents=[ids[0]],
        traceparent=None,
    )  # fmt: skip
    await m.run(
        "sql.workflows.INSERT_WORKFLOW", lambda: workflows.INSERT_WORKFLOW.row(conn, S, run)
    )


async def claim_everything(m: Machine) -> None:
    conn = m.conn
    await every_status(conn, "one")
    one = j.ClaimJobs(queue="one", limit=10, worker="w", unknown=["x"], grace=3600)
    await m.run("sql.jobs.CLAIM_ONE_QUEUE", lambda: j.CLAIM_ONE_QUEUE.rows(conn, S, one))
    await every_status(conn, "many")
    many = j.ClaimQueues(queues=["many", "one"], limit=10, worker="w", unknown=[], grace=0)
    await m.run("sql.jobs.CLAIM_QUEUES", lambda: j.CLAIM_QUEUES.rows(conn, S, many))
    for queue, per_key in (("limited", None), ("keyed", 2)):
        await aioq.admin.set_queue(conn, queue, max_running=10, max_running_per_key=per_key)
        await every_status(conn, queue, key="k" if per_key else None)
        await job(conn, "pending", queue=queue)  # a job without a key beside them

        async def limited(queue: str = queue) -> None:
            async with conn.transaction():
                await LOCK_QUEUE.row(conn, S, queue)
                claiming = j.ClaimJobs(queue=queue, limit=10, worker="w", unknown=[], grace=0)
                await CLAIM_LIMITED.rows(conn, S, claiming)

        await m.run("sql.limits.CLAIM_LIMITED", limited)


async def write_every_outcome(m: Machine) -> None:
    conn = m.conn
    others = await every_status(conn)  # the fence leaves them (and the held one: claim 1 != 2)
    keys: list[tuple[int, int]] = []
    rows: dict[int, Event] = {}
    for kind in OutcomeKind:
        for cancel_requested in (False, True):
            held = await hold(conn, await job(conn, "pending"))
            if cancel_requested:
                await conn.execute(
                    "UPDATE aioq.jobs SET cancel_requested_at = now() WHERE id = $1", held[0]
                )
            keys.append(held)
            rows[held[0]] = Event(kind.value)
    kinds = [rows[key[0]].value for key in keys] + ["retried"] * len(others)
    batch = outcomes([*keys, *((i, 2) for i in others)], kinds)
    await m.run("sql.outcomes.WRITE_OUTCOMES", lambda: WRITE_OUTCOMES.rows(conn, S, batch), rows)
    plain = [await hold(conn, await job(conn, "pending")) for _ in range(2)]
    done = outcomes(plain, ["succeeded"] * 2)
    await m.run(
        "sql.outcomes.COMPLETE",
        lambda: COMPLETE.rows(conn, S, done.ids, done.claims, "w"),
    )


async def a_run(
    conn: asyncpg.Connection, registry: aioq.Registry, on_failure: str = "cancel"
) -> tuple[int, int, int]:
    """A run: a first step, one that waits for it (``on_failure``), one that runs anyway."""
    task = registry.get("s")
    assert task is not None
    flow = aioq.Workflow("run")
    first = flow.add(task.call())
    flow.add(task.call(), after=[first], name="needs", on_failure=on_failure)
    flow.add(task.call(), after=[first], name="anyway", on_failure="run")
    run = await flow.defer(conn)
    return run.jobs["s"], run.jobs["needs"], run.jobs["anyway"]


async def write_step_outcomes(m: Machine, registry: aioq.Registry) -> None:
    conn = m.conn
    ok, _, _ = await a_run(conn, registry)
    failed, _, _ = await a_run(conn, registry)
    keys = [await hold(conn, ok), await hold(conn, failed)]
    batch = outcomes(keys, ["succeeded", "dead"])
    await m.run(
        "sql.outcomes.WRITE_STEP_OUTCOMES",
        lambda: WRITE_STEP_OUTCOMES.rows(conn, S, batch),
        {ok: Event.SUCCEEDED, failed: Event.DEAD},
    )
    # The dead step replayed: its cancelled dependent waits again.
    await m.run("sql.admin.REPLAY", lambda: REPLAY.rows(conn, S, [failed], None, None))
    # A dead step whose dependency has not succeeded is replayed into waiting.
    _, needs, _ = await a_run(conn, registry)
    await conn.execute("UPDATE aioq.jobs SET status = 'dead' WHERE id = $1", needs)
    await m.run("sql.admin.REPLAY", lambda: REPLAY.rows(conn, S, [needs], None, None))


async def release_rescue_cancel(m: Machine, registry: aioq.Registry) -> None:
    conn = m.conn
    for cancel_requested in (False, True):
        await job(conn, "running", cancel_requested=cancel_requested)
    kept = await job(conn, "running")
    await every_status(conn, worker="other")
    await m.run("sql.outcomes.RELEASE_WORKER", lambda: RELEASE_WORKER.rows(conn, S, "w", [kept]))
    await job(conn, "running", expired=True, worker="x")
    await job(conn, "running", expired=True, worker="x", attempts=5)
    await job(conn, "running", expired=True, worker="x", cancel_requested=True)
    await job(conn, "running", expired=True, worker="me")  # its own: left alone
    step, _, _ = await a_run(conn, registry)
    await hold(conn, step, "x")
    await conn.execute(
        "UPDATE aioq.jobs SET lease_expires_at = now() - interval '1 s', attempts = 5,"
        " max_attempts = 5 WHERE id = $1",
        step,
    )
    await m.run("sql.outcomes.RESCUE_EXPIRED", lambda: RESCUE_EXPIRED.rows(conn, S, 100, "me"))
    wanted = await every_status(conn)
    first, _, _ = await a_run(conn, registry)  # a pending step, cancelled with its dependent
    channels = (control_channel(S), results_channel(S), None)
    await m.run(
        "sql.control.CANCEL_JOBS",
        lambda: CANCEL_JOBS.rows(conn, S, [*wanted, first], *channels),
    )


async def replay_delete_prune(m: Machine) -> None:
    conn = m.conn
    ids = await every_status(conn, attempts=5, old=True)
    await m.run("sql.admin.REPLAY", lambda: REPLAY.rows(conn, S, ids, None, None))
    ids = await every_status(conn, old=True)
    await m.run("sql.admin.DELETE_JOBS", lambda: DELETE_JOBS.rows(conn, S, ids))
    await every_status(conn, old=True)
    for status in ("dead", "cancelled"):
        await m.run(
            "sql.maintenance.PRUNE_ENDED", lambda s=status: PRUNE_ENDED.rows(conn, S, 0, 100, s)
        )


async def test_every_status_any_statement_writes_is_a_transition_of_the_table(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(name="s")
    async def step() -> None: ...

    await conn.execute(LOG)
    m = Machine(conn)
    await defer_everything(m, registry)
    await claim_everything(m)
    await write_every_outcome(m)
    await write_step_outcomes(m, registry)
    await release_rescue_cancel(m, registry)
    await replay_delete_prune(m)
    assert m.problems == []
    assert sorted(n for n in STATEMENTS if not m.ran.get(n)) == []  # each changed a status
    dead = [t for t in TRANSITIONS if t not in m.seen]
    assert dead == [], "transitions of the table that no statement made"


def _writes_a_status(text: str) -> bool:
    jobs = '"aioq".jobs'
    update = re.compile(
        rf"UPDATE {re.escape(jobs)}(?: AS \w+)?\s+SET\s(?:(?!\b(?:FROM|WHERE|RETURNING)\b).)*?"
        r"\bstatus\s*=",
        re.S,
    )
    return (
        f"INSERT INTO {jobs}" in text or f"DELETE FROM {jobs}" in text or bool(update.search(text))
    )


def test_every_statement_that_writes_a_status_is_held_against_the_table() -> None:
    writers = {n for n, s in all_statements().items() if _writes_a_status(s.text(S))}
    assert writers == set(STATEMENTS)


def test_the_check_sees_a_status_written_in_any_form() -> None:
    for text in (
        "UPDATE \"aioq\".jobs AS j SET progress = 1, status = 'x' WHERE true",
        "UPDATE \"aioq\".jobs\nSET status = CASE WHEN true THEN 'a' END",
        'INSERT INTO "aioq".jobs (queue) VALUES (1)',
        'DELETE FROM "aioq".jobs WHERE id = 1',
    ):
        assert _writes_a_status(text), text
    assert not _writes_a_status("UPDATE \"aioq\".jobs AS j SET progress = 1 WHERE j.status = 'x'")


async def test_every_trigger_that_writes_a_status_is_held_against_the_table(
    conn: asyncpg.Connection,
) -> None:
    found = await conn.fetch(
        """
        SELECT t.tgname, pg_get_functiondef(t.tgfoid) AS body FROM pg_trigger AS t
        WHERE t.tgrelid = 'aioq.jobs'::regclass AND NOT t.tgisinternal
        """
    )
    writers = {r["tgname"] for r in found if re.search(r"\bstatus\s*:?=", r["body"])}
    assert writers == set(TRIGGERS)


def test_every_outcome_is_an_event_that_ends_a_run_and_every_event_is_in_the_table() -> None:
    for kind in OutcomeKind:
        assert [t.source for t in TRANSITIONS if t.event == kind.value] != []
        assert {t.source for t in TRANSITIONS if t.event == kind.value} == {JobStatus.RUNNING}
    assert {t.event for t in TRANSITIONS} == set(Event)


def test_the_architecture_shows_the_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert f"```mermaid\n{mermaid()}```" in text
    assert f"```text\n{table()}```" in text


def test_the_architecture_names_who_writes_each_event() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table_rows = text.split("| event | written by |", 1)[1].split("\n\n", 1)[0]
    writers: dict[str, str] = {}
    for row in table_rows.splitlines()[2:]:
        events, who = (cell.strip() for cell in row.strip("|").split("|"))
        writers.update(dict.fromkeys(events.split(", "), who))
    assert set(writers) == set(Event)
    missing = [
        f"{name} ({event})"
        for name, events in STATEMENTS.items()
        for event in events
        if f"{name.rpartition('.')[2]}`" not in writers[event]
    ]
    missing += [
        f"{name} ({event})"
        for name, events in TRIGGERS.items()
        for event in events
        if f"`{name}`" not in writers[event]
    ]
    assert missing == []
