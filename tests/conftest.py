"""Test harness: a real PostgreSQL (AIOQ_TEST_DSN or an embedded one), a fresh database per test."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from db import run_sql, with_database

import aioq
from aioq.dev.server import EmbeddedPostgres

TEMPLATE = f"aioq_template_{os.getpid()}"


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def server() -> Iterator[EmbeddedPostgres | None]:
    """The embedded server, or None when AIOQ_TEST_DSN names one."""
    if os.environ.get("AIOQ_TEST_DSN"):
        yield None
        return
    with EmbeddedPostgres(fsync=False) as pg:
        yield pg


@pytest.fixture(scope="session")
def admin_dsn(server: EmbeddedPostgres | None) -> str:
    """A DSN with the right to create databases."""
    return server.dsn if server is not None else os.environ["AIOQ_TEST_DSN"]


@pytest.fixture(scope="session")
def template_db(admin_dsn: str) -> Iterator[str]:
    """A database with the schema installed, copied for each test."""
    run_sql(admin_dsn, f'DROP DATABASE IF EXISTS "{TEMPLATE}"', f'CREATE DATABASE "{TEMPLATE}"')

    async def install() -> None:
        conn = await asyncpg.connect(with_database(admin_dsn, TEMPLATE))
        try:
            await aioq.install(conn)
        finally:
            await conn.close()

    asyncio.run(install())
    yield TEMPLATE
    run_sql(admin_dsn, f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')


@pytest.fixture
def dsn(admin_dsn: str, template_db: str) -> Iterator[str]:
    """A DSN of a fresh database of this test's own, schema installed."""
    name = f"aioq_test_{secrets.token_hex(6)}"
    run_sql(admin_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield with_database(admin_dsn, name)
    run_sql(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def conn(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to this test's database."""
    connection = await asyncpg.connect(dsn)
    yield connection
    await connection.close()


@pytest.fixture
def registry() -> aioq.Registry:
    """An empty registry of this test's own."""
    return aioq.Registry()


@pytest.fixture
def make_worker(dsn: str, registry: aioq.Registry) -> Callable[..., aioq.Worker]:
    """Build workers on this test's database with quick test-friendly defaults."""

    def make(**options: Any) -> aioq.Worker:
        options.setdefault("registry", registry)
        options.setdefault("poll_interval", 0.2)
        options.setdefault("shutdown_grace", 5.0)
        return aioq.Worker(dsn=dsn, **options)

    return make
