"""Calls that must NOT type-check: each line marked ``# error`` is a mypy error.

``test_defer.py::test_mypy_rejects_bad_defer_calls`` runs ``mypy --strict`` on this file and
checks that exactly the marked lines are reported.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

import aioq

registry = aioq.Registry()


@registry.task
async def send(order_id: int, note: str = "") -> None:
    """Send an order confirmation."""


@registry.task
def notify(user: str) -> bool:
    """Notify a user, synchronously."""
    return bool(user)


async def main(conn: asyncpg.Connection) -> None:
    """Defer with wrong arguments."""
    await send.defer(conn, order_id="x")  # error: [arg-type]
    await send.defer(conn)  # error: [call-arg] missing argument
    await send.defer(conn, order_id=1, bogus=2)  # error: [call-arg] unknown keyword
    await send.defer(conn, orderid=1)  # error: [call-arg] misspelt keyword
    await send.defer(conn, 1, 2)  # error: [arg-type] note is a str
    await send.defer(order_id=1)  # error: [call-arg] no connection
    await send.options(queue="q").defer(conn, order_id="x")  # error: [arg-type] via options
    await send.defer_many(conn, {"order_id": 1})  # error: [dict-item] not a list of calls
    send.options(delay="soon")  # error: [arg-type] seconds or a timedelta
    send.options(priority=None, bogus=1)  # error: [call-arg] unknown option
    name: str = await send.defer(conn, order_id=1)  # error: [assignment] defer returns the id
    notify(user=1)  # error: [arg-type] a direct call is checked too
    print(name)


def workflow_steps() -> None:
    """A workflow step's call is checked as defer is."""
    flow = aioq.Workflow("w")
    flow.add(send.call(order_id="x"))  # error: [arg-type] a step's arguments
    flow.add(send.call())  # error: [call-arg] missing argument
    flow.add(send.options(queue="q").call(orderid=1))  # error: [call-arg] via options
    flow.add(send.call(order_id=1), after="first")  # error: [arg-type] steps, not names


async def other_targets(
    pool: asyncpg.Pool, session: AsyncSession, sa_conn: AsyncConnection
) -> None:
    """The task's arguments are checked on every kind of connection."""
    await send.defer(pool, order_id="x")  # error: [arg-type] on a pool
    await send.defer(session, orderid=1)  # error: [call-arg] on a session
    await send.defer(sa_conn)  # error: [call-arg] on a SQLAlchemy connection
    await send.options(priority=1).defer(session, order_id=[1])  # error: [arg-type] options
    await send.defer_many(session, {"order_id": 1})  # error: [dict-item] on a session
    await send.defer("postgresql://", order_id=1)  # error: [arg-type] not a connection


def sync_targets(conn: psycopg.Connection[Any], session: Session) -> None:
    """defer_sync checks the task's arguments as defer does."""
    send.defer_sync(conn, order_id="x")  # error: [arg-type] on a psycopg connection
    send.defer_sync(session, orderid=1)  # error: [call-arg] on a session
    send.options(queue="q").defer_sync(conn)  # error: [call-arg] via options
    send.defer_many_sync(conn, {"order_id": 1})  # error: [dict-item] not a list of calls
    send.defer_sync("postgresql://", order_id=1)  # error: [arg-type] not a connection
    name: str = send.defer_sync(conn, order_id=1)  # error: [assignment] returns the id
    print(name)


def worker_options(conn: psycopg.Connection[Any]) -> None:
    """A worker's options are typed; a name that left the top level is reported."""
    aioq.Worker(dsn="postgresql://", concurency=4)  # error: [call-arg] misspelt option
    aioq.Worker(dsn="postgresql://", concurrency="4")  # error: [arg-type] not an int
    aioq.Worker(dsn="postgresql://", queues=["a"], prefetch="all")  # error: [arg-type] auto/int
    aioq.get_job_sync(conn, 1)  # error: [attr-defined] moved to aioq.admin
    aioq.admin.cancel_jobs_sync(conn, [1], reasons="x")  # error: [call-arg] misspelt keyword
