"""Calls that must type-check: ``mypy --strict`` passes on this file (see test_defer.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import asyncpg
import psycopg
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

import aioq

registry = aioq.Registry()


@registry.task
async def send(order_id: int, note: str = "") -> None:
    """Send an order confirmation."""


@registry.task(queue="mail", max_attempts=3)
def notify(user: str, *, urgent: bool = False) -> bool:
    """Notify a user, synchronously."""
    return urgent


async def main(conn: asyncpg.Connection) -> None:
    """Defer with every accepted calling convention."""
    job_id: int = await send.defer(conn, order_id=1)
    await send.defer(conn, 2, note="positional order_id")
    await send.options(priority=3, delay=5.0).defer(conn, order_id=job_id)
    await send.options(delay=timedelta(minutes=1), unique_key="k").defer(conn, order_id=4)
    ids: list[int] = await send.defer_many(conn, [{"order_id": 5}, {"order_id": 6}])
    await notify.defer(conn, user="ann", urgent=True)
    await notify.options(queue="other").defer(conn, "bob")
    assert notify(user="direct") is False
    assert ids
    flow = aioq.Workflow("w")
    first = flow.add(send.call(order_id=1))
    flow.add(send.options(priority=2).call(2, note="after"), after=[first], name="second")
    run: aioq.workflows.WorkflowRun = await aioq.chain(
        notify.call("ann"), notify.call(user="bob")
    ).defer(conn)
    await aioq.group(send.call(order_id=3), then=notify.call("x")).defer(conn)
    print(run.jobs["notify"], run.id)


async def other_targets(
    pool: asyncpg.Pool, session: AsyncSession, sa_conn: AsyncConnection
) -> None:
    """A pool, a SQLAlchemy session and a SQLAlchemy connection are accepted wherever a
    connection is."""
    await send.defer(pool, order_id=1)
    await send.defer(session, order_id=1, note="in the session's transaction")
    await send.defer(sa_conn, 3)
    await send.options(queue="q").defer(session, order_id=2)
    await send.defer_many(session, [{"order_id": 5}])
    job = await aioq.admin.get_job(session, 1)
    jobs = await aioq.admin.list_jobs(sa_conn, status="dead")
    assert job is None or jobs


def sync_targets(conn: psycopg.Connection[Any], session: Session, sa_conn: Connection) -> None:
    """defer_sync takes a psycopg connection, a SQLAlchemy Session or Connection."""
    job_id: int = send.defer_sync(conn, order_id=1)
    send.defer_sync(session, 2, note="in the session's transaction")
    send.options(priority=3, unique_key="k").defer_sync(sa_conn, order_id=job_id)
    ids: list[int] = notify.defer_many_sync(conn, [{"user": "ann"}, {"user": "bob"}])
    job = aioq.admin.get_job_sync(conn, ids[0])
    states: dict[int, str] = aioq.admin.cancel_jobs_sync(session, ids)
    value: object = aioq.result_sync(sa_conn, job_id, timeout=1.0)
    assert job is None or states or value


def worker_options(conn: psycopg.Connection[Any], session: Session) -> None:
    """Every option of a worker, as a keyword; the operations' sync twins."""
    aioq.Worker(dsn="postgresql://", queues="one", concurrency=4, prefetch="auto")
    aioq.Worker(dsn="postgresql://", queues=("a", "b"), schema=None, dead_retention=None)
    aioq.Worker(dsn="postgresql://", config=aioq.WorkerConfig(concurrency=2), listen=False)
    aioq.admin.cancel_jobs_sync(conn, [1], reason="not needed")
    replay: aioq.admin.Replay = aioq.admin.replay_sync(session, task="t")
    info: aioq.admin.QueueInfo = aioq.admin.set_queue_sync(conn, "q", paused=True)
    run = aioq.workflow_sync(conn, 1)
    assert replay.replayed or info.paused or run is None
