"""Run aioq's statements on a psycopg connection (psycopg 3, or psycopg 2): ``defer_sync``.

The job is inserted with a cursor of the caller's connection, inside its transaction: psycopg
opens one implicitly at the first statement unless the connection is in autocommit, where the
job commits at once, as the caller's own statements would. Rows are read as tuples whatever
row factory the connection has.
"""

from __future__ import annotations

from typing import Any

from aioq.dbapi import SyncExecutor, run_cursor
from aioq.errors import ConfigError

__all__ = ("executor", "executor2")


def executor(target: Any) -> SyncExecutor:
    """Return the runner of statements on a psycopg 3 ``Connection`` (or a cursor's)."""
    import psycopg
    from psycopg.rows import tuple_row

    if isinstance(target, psycopg.Cursor):
        conn = target.connection
    elif isinstance(target, psycopg.Connection):
        conn = target
    elif isinstance(target, psycopg.AsyncConnection | psycopg.AsyncCursor):
        raise ConfigError(
            "conn",
            "a psycopg AsyncConnection: defer_sync() takes a synchronous connection"
            " (psycopg.connect()); from async code, defer() on asyncpg",
        )
    else:
        raise ConfigError("conn", f"expected a psycopg Connection, got {target!r}")

    def run(sql: str, params: Any) -> Any:
        with conn.cursor(row_factory=tuple_row) as cursor:
            return run_cursor(cursor, sql, params)

    return run


def executor2(target: Any) -> SyncExecutor:
    """Return the runner of statements on a psycopg 2 connection (or a cursor's)."""
    import psycopg2.extensions

    if isinstance(target, psycopg2.extensions.cursor):
        target = target.connection
    if not isinstance(target, psycopg2.extensions.connection):
        raise ConfigError("conn", f"expected a psycopg2 connection, got {target!r}")
    conn = target

    def run(sql: str, params: Any) -> Any:
        with conn.cursor(cursor_factory=psycopg2.extensions.cursor) as cursor:
            return run_cursor(cursor, sql, params)

    return run
