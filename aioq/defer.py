"""The defer path's last step: which INSERT writes a job, with which values, and running it.

:func:`job_inserts` (one job) and :func:`jobs_insert` (many) choose among the insert
statements of :mod:`aioq.sql.jobs` from a job's options and build their values; ``defer``,
``defer_sync``, ``defer_many`` and their sync form (:mod:`aioq.tasks`), the CLI's ``jobs add``
and the Django backend all go through them, so a job is written the same way whatever the
connection. The statements and the function that fills them in live side by side, one module
apart: a change to a statement's parameters is a change to these two files.
docs/architecture.md, "Transactional defer".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import TypedDict

from aioq import hooks
from aioq.db import Executor, Target, executor
from aioq.dbapi import SyncTarget
from aioq.dbapi import executor as sync_executor
from aioq.errors import DeferError
from aioq.options import JobOptions
from aioq.sql import Statement
from aioq.sql import jobs as sql

__all__ = (
    "UNIQUE_TRIES",
    "Insert",
    "defer_job",
    "defer_job_sync",
    "defer_jobs",
    "defer_jobs_sync",
    "insert_job",
    "job_inserts",
    "jobs_insert",
    "key_kept_moving",
)

_NO_HOOK = contextlib.nullcontext()


Insert = tuple[Statement[int], tuple[object, ...]]
"""A statement that inserts jobs, and its values."""

UNIQUE_TRIES = 10
"""Times an insert with a unique_key is tried while the live job holding the key keeps ending."""


class _Job(TypedDict):
    """What every insert of one job takes (sql.InsertJob's fields; mypy holds the two together)."""

    queue: str
    task: str
    args: str
    priority: int
    run_at: datetime | None
    delay: float
    max_attempts: int
    lease: float
    traceparent: str | None


class _Jobs(TypedDict):
    """What every insert of many jobs takes (sql.InsertJobs' fields)."""

    queue: str
    task: str
    priority: int
    run_at: datetime | None
    delay: float
    max_attempts: int
    lease: float
    args: list[str]
    traceparent: str | None


def job_inserts(
    name: str,
    opts: JobOptions,
    encoded: str,
    traceparent: str | None = None,
    concurrency_key: str | None = None,
) -> Iterator[Insert]:
    """Yield the insert of one job of task ``name``, as many times as the caller may run it.

    The caller runs each until one returns an id, else raises :func:`key_kept_moving`. Only the
    insert with a unique_key can return none: the live job holding the key ended between the
    conflict and the read, and the next try sees that. Both ``defer`` and ``defer_sync`` run
    these, so a job is written the same way whatever the connection.

    ``concurrency_key``: the key the task's key function gave (the options' own comes first).
    A window (unique_for), a replace or a key takes INSERT_UNIQUE_JOB_FOR; without them the
    statements are the ones they always were.
    """
    key = opts.concurrency_key if opts.concurrency_key is not None else concurrency_key
    if opts.at_defaults and traceparent is None and key is None:  # the common case
        yield sql.INSERT_DEFAULT_JOB, (opts.queue, name, encoded)
        return
    job: _Job = {
        "queue": opts.queue,
        "task": name,
        "args": encoded,
        "priority": opts.priority,
        "run_at": opts.run_at,
        "delay": opts.delay,
        "max_attempts": opts.max_attempts,
        "lease": opts.lease,
        "traceparent": traceparent,
    }
    if opts.unique_key is None:
        if key is None:
            yield sql.INSERT_JOB.bind(sql.InsertJob(**job))
        else:
            yield sql.INSERT_KEYED_JOB.bind(sql.InsertKeyedJob(**job, concurrency_key=key))
        return
    if opts.unique_for is None and opts.on_conflict == "keep" and key is None:
        insert = sql.INSERT_UNIQUE_JOB.bind(sql.InsertUniqueJob(**job, unique_key=opts.unique_key))
    else:
        unique = sql.InsertUniqueJobFor(
            **job,
            unique_key=opts.unique_key,
            unique_for=opts.unique_for,
            replace=opts.on_conflict == "replace",
            concurrency_key=key,
        )
        insert = sql.INSERT_UNIQUE_JOB_FOR.bind(unique)
    for _ in range(UNIQUE_TRIES):
        yield insert


def key_kept_moving(name: str, opts: JobOptions) -> DeferError:
    """The error of a unique_key whose live job ended at every try of :func:`job_inserts`."""
    return DeferError(name, f"unique_key {opts.unique_key!r} kept changing owner")


def jobs_insert(
    name: str,
    opts: JobOptions,
    encoded: Sequence[str],
    traceparent: str | None = None,
    keys: Sequence[str | None] | None = None,
) -> Insert:
    """The one statement that inserts many jobs of task ``name``; its ids come back in order.

    ``keys``: each job's concurrency key (None: the options' own, if any, for every job).
    """
    if opts.unique_key is not None:
        raise DeferError(name, "unique_key applies to one job; defer_many cannot use it")
    jobs: _Jobs = {
        "queue": opts.queue,
        "task": name,
        "priority": opts.priority,
        "run_at": opts.run_at,
        "delay": opts.delay,
        "max_attempts": opts.max_attempts,
        "lease": opts.lease,
        "args": list(encoded),
        "traceparent": traceparent,
    }
    if opts.concurrency_key is not None:
        keys = [opts.concurrency_key] * len(encoded)
    if keys is None:
        return sql.INSERT_JOBS.bind(sql.InsertJobs(**jobs))
    return sql.INSERT_KEYED_JOBS.bind(sql.InsertKeyedJobs(**jobs, concurrency_keys=list(keys)))


async def insert_job(
    schema: str,
    conn: Executor,
    name: str,
    opts: JobOptions,
    encoded: str,
    traceparent: str | None = None,
    concurrency_key: str | None = None,
) -> int:
    """Insert one job of task ``name`` with these options and return its id (with a
    unique_key: the live job's, or the one its unique_for window remembers)."""
    for statement, values in job_inserts(name, opts, encoded, traceparent, concurrency_key):
        job_id = await statement.row(conn, schema, *values)
        if job_id is not None:
            return job_id
    raise key_kept_moving(name, opts)


async def defer_job(
    conn: Target, schema: str, name: str, opts: JobOptions, encoded: str, key: str | None
) -> int:
    """Write one job of task ``name`` (its arguments checked and encoded) on the caller's
    connection, inside its transaction, as ``defer`` does; return its id. The observers
    (:mod:`aioq.hooks`) see it."""
    db = await executor(conn)
    if not hooks.observers:
        return await insert_job(schema, db, name, opts, encoded, None, key)
    deferral = hooks.Deferral(name, opts.queue, 1)
    with hooks.deferring(deferral):
        traceparent = deferral.traceparent
        job_id = await insert_job(schema, db, name, opts, encoded, traceparent, key)
        deferral.ids = (job_id,)
        return job_id


async def defer_jobs(
    conn: Target,
    schema: str,
    name: str,
    opts: JobOptions,
    encoded: Sequence[str],
    keys: Sequence[str | None] | None,
) -> list[int]:
    """Write many jobs of task ``name`` in one statement, as ``defer_many`` does; return their
    ids in order."""
    db = await executor(conn)
    deferral = hooks.Deferral(name, opts.queue, len(encoded))
    with hooks.deferring(deferral) if hooks.observers else _NO_HOOK:
        traceparent = deferral.traceparent
        statement, values = jobs_insert(name, opts, encoded, traceparent, keys)
        deferral.ids = await statement.rows(db, schema, *values)
        return list(deferral.ids)


def defer_job_sync(
    conn: SyncTarget, schema: str, name: str, opts: JobOptions, encoded: str, key: str | None
) -> int:
    """:func:`defer_job` on a synchronous connection (:mod:`aioq.dbapi`), as ``defer_sync``
    does: the same statements, with the same values."""
    db = sync_executor(conn)
    deferral = hooks.Deferral(name, opts.queue, 1)
    with hooks.deferring(deferral) if hooks.observers else _NO_HOOK:
        traceparent = deferral.traceparent
        for statement, values in job_inserts(name, opts, encoded, traceparent, key):
            job_id = statement.row_sync(db, schema, *values)
            if job_id is not None:
                deferral.ids = (job_id,)
                return job_id
        raise key_kept_moving(name, opts)


def defer_jobs_sync(
    conn: SyncTarget,
    schema: str,
    name: str,
    opts: JobOptions,
    encoded: Sequence[str],
    keys: Sequence[str | None] | None,
) -> list[int]:
    """:func:`defer_jobs` on a synchronous connection, as ``defer_many_sync`` does."""
    db = sync_executor(conn)
    deferral = hooks.Deferral(name, opts.queue, len(encoded))
    with hooks.deferring(deferral) if hooks.observers else _NO_HOOK:
        traceparent = deferral.traceparent
        statement, values = jobs_insert(name, opts, encoded, traceparent, keys)
        deferral.ids = statement.rows_sync(db, schema, *values)
        return list(deferral.ids)
