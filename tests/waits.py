"""How tests wait for a state (one async helper, one sync helper, each with a hang guard).

Prefer an event: a service's ``passed`` signal, a task's ``anyio.Event``, a NOTIFY. These poll
only where no event exists: a row changed by another process or connection (the database has
nothing to wait on), a child process's output, an HTTP endpoint.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

import anyio
import asyncpg

__all__ = ("HANG_GUARD", "eventually", "until_sql", "wait_for")

T = TypeVar("T")

HANG_GUARD = 60.0
"""A deadline for "never", not a timing: a healthy wait ends long before it."""


@overload
async def eventually(
    check: Callable[[], Awaitable[T]], what: str = ..., guard: float = ..., *, every: float = ...
) -> T: ...
@overload
async def eventually(
    check: Callable[[], T], what: str = ..., guard: float = ..., *, every: float = ...
) -> T: ...
async def eventually(
    check: Callable[[], Any],
    what: str = "the condition",
    guard: float = HANG_GUARD,
    *,
    every: float = 0.02,
) -> Any:
    """Return ``check()``'s first truthy result (awaited if it is a coroutine); fail naming
    ``what`` after ``guard`` seconds (a hang guard, not a timing)."""
    try:
        with anyio.fail_after(guard):
            while True:
                result = check()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return result
                await anyio.sleep(every)
    except TimeoutError:
        raise AssertionError(f"timed out after {guard:g}s waiting for {what}") from None


async def until_sql(
    conn: asyncpg.Connection | asyncpg.Pool, sql: str, *args: object, guard: float = HANG_GUARD
) -> None:
    """Wait until ``sql`` returns true in the database.

    Other connections change the rows and PostgreSQL offers no event for "this query's answer
    changed", so this is the one place that polls the database.
    """
    try:
        with anyio.fail_after(guard):
            # A row has no event to wait on (see above): the one justified busy-wait.
            while not await conn.fetchval(sql, *args):  # noqa: ASYNC110
                await anyio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out after {guard:g}s waiting for: {sql} {args}") from None


def wait_for(
    predicate: Callable[[], object],
    what: str,
    timeout: float = HANG_GUARD,
    *,
    on_timeout: Callable[[], str] = lambda: "",
    every: float = 0.1,
) -> float:
    """Poll ``predicate`` (outside any event loop) until true; return the seconds waited; fail
    naming ``what`` after ``timeout``, with ``on_timeout()`` (e.g. a worker's log; its tail)
    as context."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            tail = on_timeout()[-4000:]
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{tail}")
        time.sleep(every)
    return time.monotonic() - started
