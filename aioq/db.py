"""What aioq runs statements on: the caller's connection, a pool, or another library's session.

``defer`` and the admin functions take a :data:`Target`; :func:`executor` turns it into the
asyncpg connection or pool to run on, inside the caller's transaction. Adapters of other
libraries' connection objects come through an entry-point group (:data:`ADAPTERS`), so the core
names no integration.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Hashable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from aioq.errors import ConfigError

if TYPE_CHECKING:  # only for the annotations: SQLAlchemy is imported when a caller passes it
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = (
    "ADAPTERS",
    "WAIT_ADAPTERS",
    "Connection",
    "Executor",
    "Opener",
    "Row",
    "SyncExecutor",
    "Target",
    "executor",
    "wait_opener",
)

Connection: TypeAlias = asyncpg.Connection | PoolConnectionProxy
"""A connection the caller owns: ``defer`` runs on it, inside its transaction."""

Executor: TypeAlias = asyncpg.Connection | PoolConnectionProxy | asyncpg.Pool
"""Anything that runs a statement: a connection, or a pool that lends one for it."""

Target: TypeAlias = "Executor | AsyncConnection | AsyncSession"
"""What ``defer`` and the admin functions accept: an asyncpg connection or pool, or a SQLAlchemy
``AsyncConnection`` / ``AsyncSession`` on the asyncpg driver (its connection and transaction)."""


class Row(Protocol):
    """A result row, by column position or name (asyncpg's Record; a synchronous driver's row)."""

    def __getitem__(self, key: int | str, /) -> Any: ...

    def items(self) -> Iterator[tuple[str, Any]]: ...


SyncExecutor: TypeAlias = Callable[[str, Mapping[str, object]], list[Row]]
"""A synchronous caller's connection as aioq runs statements on it (aioq.dbapi makes one): it
runs one statement (``pyformat`` text, its values by name) in the caller's transaction and
returns its rows (none for a statement without a result)."""

_ASYNCPG = (asyncpg.Connection, PoolConnectionProxy, asyncpg.Pool)

ADAPTERS = "aioq.executors"
"""The entry-point group of adapters for other libraries' connection objects.

An entry point's name is the top-level package of the classes it adapts (``sqlalchemy``), its
value an ``async def (obj) -> asyncpg.Connection`` that returns the connection to run on inside
the object's transaction (aioq's own: ``aioq.contrib.sqlalchemy:executor``, in pyproject.toml).
One is loaded the first time an object of its package arrives: ``import aioq`` loads neither
the adapter nor its library, and the core does not know which adapters exist.
"""

Adapter: TypeAlias = Callable[[Any], Awaitable[Executor]]


@functools.cache
def _adapter(package: str, group: str = ADAPTERS) -> Any:
    from importlib.metadata import entry_points  # only off the asyncpg path: it reads metadata

    found = entry_points(group=group, name=package)
    return next((point.load() for point in found), None)


WAIT_ADAPTERS = "aioq.wait_executors"
"""The entry-point group of adapters that wait outside the caller's transaction.

Awaiting a result (:func:`aioq.result`) on a session must not poll inside the session's open
transaction (which it would begin if none was open, and where a LISTEN takes effect only at
commit). An entry point here (named as in :data:`ADAPTERS`) is an ``async def (obj) -> (key,
opener)``: ``opener()`` an async context manager lending a connection of the object's own
pool, outside any transaction; ``key`` names that pool, so that every waiter of the process on
it shares one such connection (aioq's own: ``aioq.contrib.sqlalchemy:wait_opener``).
"""

Opener: TypeAlias = Callable[[], AbstractAsyncContextManager[asyncpg.Connection]]
"""Lends a connection outside any transaction, and takes it back on exit."""


async def wait_opener(target: Target) -> tuple[Hashable, Opener] | None:
    """Return the pool's key and the opener of a connection outside ``target``'s transaction,
    for a library object whose adapter has one; None for asyncpg's own objects."""
    if isinstance(target, _ASYNCPG):
        return None
    for cls in type(target).__mro__:
        resolve = _adapter(cls.__module__.partition(".")[0], WAIT_ADAPTERS)
        if resolve is not None:
            found: tuple[Hashable, Opener] | None = await resolve(target)
            return found
    return None


async def executor(target: Target) -> Executor:
    """Return the asyncpg connection or pool to run statements on for ``target``."""
    if isinstance(target, _ASYNCPG):
        return target
    # By the class or a base: an application's own AsyncSession subclass lives in its module.
    for cls in type(target).__mro__:
        resolve: Adapter | None = _adapter(cls.__module__.partition(".")[0])
        if resolve is not None:
            return await resolve(target)
    raise ConfigError(
        "conn",
        f"got {type(target).__module__}.{type(target).__qualname__}; expected an asyncpg"
        " Connection or Pool, or a SQLAlchemy AsyncConnection or AsyncSession on the"
        " asyncpg driver",
    )
