"""Database helpers shared by the tests and the chaos suite (one copy of each)."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg


def with_database(dsn: str, database: str) -> str:
    """Return ``dsn`` pointing at another database."""
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{database}"))


async def _execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def run_sql(dsn: str, *statements: str) -> None:
    """Run statements on a connection of their own (outside any test's event loop)."""
    asyncio.run(_execute(dsn, *statements))


def fetch(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    """Rows of one statement, on a connection of its own (outside any test's event loop)."""

    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()

    return asyncio.run(run())
