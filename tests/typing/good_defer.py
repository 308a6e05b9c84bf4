"""Calls that must type-check: ``mypy --strict`` passes on this file (see test_defer.py)."""

from __future__ import annotations

from datetime import timedelta

import asyncpg

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
