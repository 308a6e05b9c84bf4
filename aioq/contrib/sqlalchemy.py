"""Run aioq's statements on a SQLAlchemy session or connection, async (``defer``) or not.

``defer(session, ...)`` must join the session's transaction, so that a rollback leaves no job.
SQLAlchemy's asyncpg adapter opens its driver-level transaction lazily, at the first statement it
runs itself; a job inserted straight on the driver connection before that would commit on its
own. So the first time, a trivial statement goes through SQLAlchemy (which begins exactly as it
would for the caller's own first query), and from then on aioq uses the asyncpg connection
underneath. aioq binds arguments as text and reads jsonb back as text, so the JSON codecs
SQLAlchemy installs on that connection never touch aioq's values.

A synchronous ``Session`` or ``Connection`` (``defer_sync``) needs nothing of the kind: each
statement goes through SQLAlchemy's ``exec_driver_sql``, which begins the transaction as the
caller's own first statement would, on a driver that takes ``pyformat`` parameters. It
needs none of SQLAlchemy's asyncio extension (nor greenlet, which SQLAlchemy 2.1 no longer
installs): that is imported by the async functions, when they are first called.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import asyncpg
from sqlalchemy import text
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.orm import Session

from aioq.dbapi import SyncExecutor, named_rows
from aioq.errors import ConfigError
from aioq.sql import DEFAULT_SCHEMA
from aioq.sql.admin import PING

if TYPE_CHECKING:  # imported where used: the sync path must not need the asyncio extras
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = ("executor", "sync_executor", "wait_opener")

SUPPORTED = (
    "aioq runs on asyncpg: use an engine URL of the form 'postgresql+asyncpg://...'"
    " (install 'aioq-pg[sqlalchemy]'), or pass an asyncpg Connection or Pool"
)


async def executor(target: AsyncSession | AsyncConnection) -> asyncpg.Connection:
    """Return the asyncpg connection of ``target``, inside its current transaction."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(target, AsyncSession):
        if target.bind is not None:  # refuse before connecting through the wrong driver
            check_driver(target.bind.dialect.driver)
        conn = await target.connection()  # begins the session's transaction if none yet
    elif isinstance(target, AsyncConnection):
        conn = target
    else:
        raise ConfigError(
            "conn", f"expected a SQLAlchemy AsyncSession or AsyncConnection, got {target!r}"
        )
    check_driver(conn.dialect.driver)
    raw = await conn.get_raw_connection()
    driver = raw.driver_connection
    if not isinstance(driver, asyncpg.Connection):
        raise ConfigError(
            "conn", f"a SQLAlchemy connection without asyncpg underneath; {SUPPORTED}"
        )
    if not driver.is_in_transaction():
        # Let SQLAlchemy begin (autobegin for a connection, BEGIN on the driver); in autocommit
        # isolation it begins nothing and the job commits at once, as the caller's own would.
        await conn.execute(text(PING.text(DEFAULT_SCHEMA)))
    return driver


async def wait_opener(
    target: AsyncSession | AsyncConnection,
) -> tuple[Hashable, Callable[[], AbstractAsyncContextManager[asyncpg.Connection]]] | None:
    """Return the engine of ``target`` (its key) and an opener of one of its connections,
    outside any transaction: what ``aioq.result`` waits on, instead of the caller's connection
    and its transaction. None when the session has no engine to draw from (per-mapper binds):
    the wait then runs on the session's own connection."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    bind = target.bind if isinstance(target, AsyncSession) else target.engine
    engine = bind.engine if isinstance(bind, AsyncConnection) else bind
    if not isinstance(engine, AsyncEngine):
        return None
    check_driver(engine.dialect.driver)

    @asynccontextmanager
    async def opener() -> AsyncIterator[asyncpg.Connection]:
        async with engine.connect() as conn:
            raw = await conn.get_raw_connection()
            driver = raw.driver_connection
            if not isinstance(driver, asyncpg.Connection):
                raise ConfigError("conn", f"a SQLAlchemy engine without asyncpg; {SUPPORTED}")
            # aioq runs on the driver, so SQLAlchemy begins nothing: each statement commits
            # on its own, and a LISTEN takes effect at once.
            yield driver

    return id(engine), opener


def check_driver(driver: str | None) -> None:
    """Raise a ConfigError naming what is supported unless the driver is asyncpg."""
    if driver != "asyncpg":
        raise ConfigError("conn", f"a SQLAlchemy session on the {driver!r} driver; {SUPPORTED}")


SYNC_SUPPORTED = (
    "defer_sync() runs on PostgreSQL through psycopg or psycopg2: use an engine URL of the"
    " form 'postgresql+psycopg://...' (or an AsyncSession on asyncpg with defer())"
)


def sync_executor(target: Session | Connection) -> SyncExecutor:
    """Return the runner of statements on a synchronous ``Session`` or ``Connection``."""
    if isinstance(target, Session):
        if target.bind is not None:  # refuse before connecting through the wrong driver
            check_sync_dialect(target.bind.dialect)
        conn = target.connection()  # begins the session's transaction if none yet
    elif isinstance(target, Connection):
        conn = target
    else:
        raise ConfigError(
            "conn",
            f"expected a SQLAlchemy Session or Connection, got {type(target).__qualname__}"
            " (an Engine: pass engine.begin()'s connection)",
        )
    check_sync_dialect(conn.dialect)

    def run(sql: str, params: Any) -> Any:
        result = conn.exec_driver_sql(sql, params)
        if not result.returns_rows:
            return []
        return named_rows(list(result.keys()), result.fetchall())

    return run


def check_sync_dialect(dialect: Dialect) -> None:
    """Raise a ConfigError naming what is supported unless the dialect is PostgreSQL with
    ``pyformat`` parameters."""
    if dialect.name != "postgresql" or dialect.paramstyle != "pyformat":
        raise ConfigError(
            "conn", f"a SQLAlchemy session on {dialect.name}+{dialect.driver}; {SYNC_SUPPORTED}"
        )
