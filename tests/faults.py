"""Fault injection at the driver: a pool whose replies to one statement are lost or late.

The worker is given the pool (``Worker(pool=...)``); the statement runs and commits on the
server as usual, then the fault replaces its reply, as when a connection drops between the
commit and the reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from aioq.sql import DEFAULT_SCHEMA, Named, Statement

# Called with the statement's arguments and its rows, after it committed; may raise or hang.
After = Callable[[Sequence[object], list[Any]], Awaitable[None]]


@asynccontextmanager
async def pool_with_fault(
    dsn: str,
    statement: Statement[Any] | Named[Any, Any],
    after: After,
    *,
    schema: str = DEFAULT_SCHEMA,
) -> AsyncIterator[asyncpg.Pool]:
    """A pool on which every run of ``statement`` is followed by ``after``."""
    text = statement.text(schema)

    class Faulty(asyncpg.Connection):  # type: ignore[misc]
        async def fetch(self, query: str, *args: object, **kwargs: Any) -> list[Any]:
            rows: list[Any] = await super().fetch(query, *args, **kwargs)
            if query == text:
                await after(args, rows)
            return rows

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, connection_class=Faulty)
    try:
        yield pool
    finally:
        await pool.close()
