"""``Task.result`` and ``aioq.result`` typing: lines marked ``# error`` must be mypy errors.

``test_results.py::test_mypy_types_results_by_the_task`` runs ``mypy --strict`` on this file and
checks that exactly the marked lines are reported (the others type-check).
"""

from __future__ import annotations

import asyncpg

import aioq

registry = aioq.Registry()


@registry.task(result_ttl=3600)
async def total(order_id: int) -> int:
    """An async task: its result is what the coroutine returns."""
    return order_id * 2


@registry.task(result_ttl=60)
def label(order_id: int) -> str:
    """A sync task: its result is what it returns."""
    return str(order_id)


async def main(pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
    """Await results typed by their task."""
    jid = await total.defer(conn, order_id=1)
    value: int = await total.result(pool, jid, timeout=30.0)
    text: str = await label.result(conn, jid)
    anything: int = await aioq.result(pool, jid, timeout=30.0)
    wrong: str = await total.result(pool, jid)  # error: [assignment]
    also_wrong: int = await label.result(pool, jid)  # error: [assignment]
    await total.result(pool, "1")  # error: [call-overload]
    await total.result(pool, jid, timeout="soon")  # error: [call-overload]
    print(value, text, anything, wrong, also_wrong)
