"""Synchronous connections: what ``defer_sync`` and the ``*_sync`` admin functions run on.

A synchronous caller (a Django view, a Flask handler, a script) holds a connection of a
DB-API driver on PostgreSQL: psycopg 3 or 2, through Django or SQLAlchemy or on its own.
:func:`executor` turns it into a :data:`SyncExecutor`, a function that runs one statement on
that connection, inside the caller's transaction, with the DB-API ``pyformat`` parameters
(``%(queue)s``) that :meth:`aioq.sql.Statement.text` renders with ``sync=True``; the statements
(the async path's, declared once in :mod:`aioq.sql`) run on it with ``rows_sync`` and
``row_sync``.

Adapters come through the entry-point group :data:`ADAPTERS`, named by the top-level package
of the objects they adapt (aioq's own are ``psycopg``, ``psycopg2``, ``sqlalchemy`` and
``django``, in pyproject.toml): ``import aioq`` imports none of those libraries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

from aioq.db import Row, SyncExecutor
from aioq.errors import ConfigError

if TYPE_CHECKING:  # only for the annotations: each library is imported when a caller passes it
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.orm import Session

__all__ = (
    "ADAPTERS",
    "DBAPIConnection",
    "NamedRow",
    "SyncExecutor",
    "SyncTarget",
    "executor",
    "named_rows",
    "run_cursor",
    "sqlstate",
)

T = TypeVar("T")


class DBAPIConnection(Protocol):
    """A DB-API connection: psycopg's (3 or 2), or Django's ``connection``."""

    def cursor(self) -> object: ...


SyncTarget: TypeAlias = "DBAPIConnection | Session | SAConnection"
"""What ``defer_sync`` and the ``*_sync`` functions accept: a psycopg 3 ``Connection`` (or one
of its cursors) or a psycopg 2 connection, Django's ``connection`` / ``connections[alias]`` on
PostgreSQL, or a SQLAlchemy ``Session`` / ``Connection`` on a PostgreSQL driver that takes
``pyformat`` parameters (psycopg, psycopg2)."""

ADAPTERS = "aioq.sync_executors"
"""The entry-point group of synchronous adapters: an entry point's name is the top-level
package of the classes it adapts, its value a ``(obj) -> SyncExecutor``."""


class NamedRow:
    """A row of a DB-API cursor, by column position or name (what statements' builders read)."""

    __slots__ = ("_names", "_values")

    def __init__(self, names: Mapping[str, int], values: Sequence[object]) -> None:
        self._names = names
        self._values = values

    def __getitem__(self, key: int | str, /) -> Any:
        return self._values[key if isinstance(key, int) else self._names[key]]

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((name, self._values[i]) for name, i in self._names.items())

    def __repr__(self) -> str:
        return f"NamedRow({dict(self.items())!r})"


def named_rows(names: Sequence[str], values: Sequence[Sequence[object]]) -> list[Row]:
    """Rows of one result, its column names shared."""
    index = {name: i for i, name in enumerate(names)}
    return [NamedRow(index, row) for row in values]


class _Cursor(Protocol):
    @property
    def description(self) -> Sequence[Any] | None: ...

    def execute(self, query: str, params: Mapping[str, object], /) -> object: ...

    def fetchall(self) -> Sequence[Sequence[object]]: ...


def run_cursor(cursor: _Cursor, sql: str, params: Mapping[str, object]) -> list[Row]:
    """Run a statement on a DB-API cursor and return its rows (the cursor's to close)."""
    cursor.execute(sql, params)
    if cursor.description is None:
        return []
    return named_rows([column[0] for column in cursor.description], cursor.fetchall())


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a statement's error, however the caller's library wrapped the driver's
    (psycopg 3's ``sqlstate``, psycopg 2's ``pgcode``; Django's and SQLAlchemy's wrappers hold
    the driver's error as their cause or ``orig``); None for any other error."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        code = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
        if isinstance(code, str):
            return code
        todo += [getattr(error, "orig", None), error.__cause__, error.__context__]
    return None


Adapter: TypeAlias = Callable[[Any], SyncExecutor]


@functools.cache
def _adapter(package: str) -> Adapter | None:
    from importlib.metadata import entry_points  # read only when a connection first arrives

    found = entry_points(group=ADAPTERS, name=package)
    return next((point.load() for point in found), None)


def executor(target: SyncTarget) -> SyncExecutor:
    """Return the function that runs statements on ``target``, inside its transaction."""
    # By the class or a base: an application's own Session subclass lives in its module.
    for cls in type(target).__mro__:
        resolve = _adapter(cls.__module__.partition(".")[0])
        if resolve is not None:
            return resolve(target)
    raise ConfigError(
        "conn",
        f"got {type(target).__module__}.{type(target).__qualname__}; expected a psycopg"
        " Connection, Django's connection, or a SQLAlchemy Session or Connection (on psycopg"
        " or psycopg2); an asyncpg connection or async session takes defer() instead",
    )
