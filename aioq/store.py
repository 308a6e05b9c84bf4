"""The dashboard's statements (aioq.web), one method each, for one schema."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import asyncpg

from aioq import queries as q
from aioq.db import Connection, Executor

__all__ = ("Connection", "Store")


class Store:
    """The statements of one schema, rendered once."""

    def __init__(self, schema: str = q.DEFAULT_SCHEMA) -> None:
        self.schema = schema
        render = functools.partial(q.render, schema=schema)
        self._dash_pending = render(q.DASH_PENDING)
        self._dash_states = render(q.DASH_STATES)
        self._dash_workers = render(q.DASH_WORKERS)
        self._dash_page = render(q.DASH_PAGE)
        self._dash_dead_page = render(q.DASH_DEAD_PAGE)
        self._dash_cancelled_page = render(q.DASH_CANCELLED_PAGE)
        self._set_statement_timeout = q.SET_STATEMENT_TIMEOUT
        self._history_totals = render(q.HISTORY_TOTALS)
        self._history_series = render(q.HISTORY_SERIES)
        self._rollup_totals = render(q.ROLLUP_TOTALS)
        self._rollup_series = render(q.ROLLUP_SERIES)

    @staticmethod
    @functools.cache
    def for_schema(schema: str) -> Store:
        """Return the shared store of a schema."""
        return Store(schema)

    async def history_totals(self, conn: Executor, seconds: float) -> Sequence[asyncpg.Record]:
        """Return per (queue, task) outcome counts and histograms of the last ``seconds``."""
        return await conn.fetch(self._history_totals, seconds)

    async def history_series(
        self, conn: Executor, seconds: float, step: float, queue: str | None = None
    ) -> Sequence[asyncpg.Record]:
        """Return outcome counts per queue (per task of ``queue``) in steps over ``seconds``."""
        return await conn.fetch(self._history_series, seconds, step, queue)

    async def rollup_totals(self, conn: Executor, seconds: float) -> Sequence[asyncpg.Record]:
        """:meth:`history_totals` from the half-hour rollup: the half hours ``seconds`` overlap."""
        return await conn.fetch(self._rollup_totals, seconds)

    async def rollup_series(
        self, conn: Executor, seconds: float, step: float, queue: str | None = None
    ) -> Sequence[asyncpg.Record]:
        """:meth:`history_series` from the half-hour rollup (``step``: a multiple of its)."""
        return await conn.fetch(self._rollup_series, seconds, step, queue)

    # --- the dashboard: bounded reads (aioq.web) ---

    async def dash_pending(
        self, conn: Executor, max_queues: int, cap: int, max_priorities: int
    ) -> Sequence[asyncpg.Record]:
        """Return per queue: ready, scheduled, sampled, oldest_ready_age (counts stop at cap)."""
        return await conn.fetch(self._dash_pending, max_queues, cap, max_priorities)

    async def dash_states(self, conn: Executor, cap: int) -> Sequence[asyncpg.Record]:
        """Return (queue, state, n): running, expired, dead, cancelled (at most cap of each)."""
        return await conn.fetch(self._dash_states, cap)

    async def dash_workers(self, conn: Executor, cap: int, limit: int) -> Sequence[asyncpg.Record]:
        """Return the workers' rows with the jobs each runs now."""
        return await conn.fetch(self._dash_workers, cap, limit)

    async def dash_page(
        self,
        conn: Executor,
        *,
        before: int | None,
        window: int,
        status: str | None,
        queue: str | None,
        task: str | None,
        text: str | None,
        limit: int,
    ) -> Sequence[asyncpg.Record]:
        """Return a page of jobs below ``before``, newest first, read from a bounded window."""
        sql = {"dead": self._dash_dead_page, "cancelled": self._dash_cancelled_page}.get(
            status or "", self._dash_page
        )
        return await conn.fetch(sql, before, window, status, queue, task, text, limit)

    async def set_statement_timeout(self, conn: Executor, seconds: float) -> None:
        """Bound every statement of the current transaction to ``seconds``."""
        await conn.execute(self._set_statement_timeout, f"{int(seconds * 1000)}ms")
