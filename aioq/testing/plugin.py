"""The pytest plugin (entry point ``pytest11``): a throwaway queue for each test.

Fixtures, all named ``aioq_*`` so they never shadow a project's own:

- ``aioq_dsn``: a DSN of a database made for this test session (on the embedded PostgreSQL,
  or on the server of ``AIOQ_TEST_DSN``), with the registry's schema dropped and installed
  afresh for each test;
- ``aioq_registry``: the registry whose tasks the tests run (``aioq.registry.default_registry``;
  override it in your conftest.py to return your app's);
- ``aioq_conn``: an asyncpg connection to ``aioq_dsn``;
- ``aioq_worker``: a worker serving the registry's queues, started for the test;
- ``aioq_drain``: ``await aioq_drain()`` runs every ready job (and the jobs those defer) and
  returns what happened to each.

Async fixtures run under anyio's own pytest plugin: mark tests ``@pytest.mark.anyio``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from aioq.migrate import install
from aioq.registry import Registry, default_registry
from aioq.sql.admin import PENDING_TASKS
from aioq.sql.schema import DROP_SCHEMA, create_database, drop_database
from aioq.testing.helpers import REGISTRY_FIX, Drain, Ran, drain
from aioq.worker import Worker

__all__ = (
    "aioq_conn",
    "aioq_database",
    "aioq_drain",
    "aioq_dsn",
    "aioq_registry",
    "aioq_server_dsn",
    "aioq_worker",
)

TEST_DSN_VARIABLE = "AIOQ_TEST_DSN"

_T = TypeVar("_T")


def _run(coro: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine to completion in a thread of its own, away from any test's loop."""
    result: list[_T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro()))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="aioq-pytest")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def _with_database(dsn: str, database: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{database}"))


async def _execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def aioq_server_dsn() -> Iterator[str]:
    """A DSN with the right to create databases: ``AIOQ_TEST_DSN``, else an embedded server."""
    if dsn := os.environ.get(TEST_DSN_VARIABLE):
        yield dsn
        return
    from aioq.dev.server import EmbeddedPostgres

    with EmbeddedPostgres(fsync=False) as server:
        yield server.dsn


@pytest.fixture(scope="session")
def aioq_database(aioq_server_dsn: str) -> Iterator[str]:
    """A DSN of a database created for this test session, dropped at its end."""
    name = f"aioq_pytest_{secrets.token_hex(6)}"
    _run(lambda: _execute(aioq_server_dsn, create_database(name)))
    yield _with_database(aioq_server_dsn, name)
    _run(lambda: _execute(aioq_server_dsn, drop_database(name)))


@pytest.fixture
def aioq_registry() -> Registry:
    """The registry whose tasks the tests run; override to return your app's."""
    return default_registry


@pytest.fixture
def aioq_dsn(aioq_database: str, aioq_registry: Registry) -> str:
    """The session's database, with the registry's schema installed afresh for this test."""

    async def fresh_schema() -> None:
        conn = await asyncpg.connect(aioq_database)
        try:
            await DROP_SCHEMA.run(conn, aioq_registry.schema)
            await install(conn, schema=aioq_registry.schema)
        finally:
            await conn.close()

    _run(fresh_schema)
    return aioq_database


@pytest.fixture
async def aioq_conn(aioq_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """An asyncpg connection to the test's database."""
    conn = await asyncpg.connect(aioq_dsn)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def aioq_worker(aioq_dsn: str, aioq_registry: Registry) -> AsyncIterator[Worker]:
    """A worker serving every queue of the registry's tasks, running for the test.

    When the test ends, jobs it left waiting for a task the registry lacks, or in a queue it
    does not serve, are named in a RegistryWarning (pytest's warnings summary).
    """
    tasks = (aioq_registry.get(name) for name in aioq_registry)
    queues = sorted({task.defaults.queue for task in tasks if task is not None} | {"default"})
    if not len(aioq_registry):
        warnings.warn(
            f"aioq_worker's registry has no task: its worker runs nothing; {REGISTRY_FIX}",
            RegistryWarning,
            stacklevel=1,
        )
    worker = Worker(
        dsn=aioq_dsn, registry=aioq_registry, queues=queues, poll_interval=0.1, shutdown_grace=5.0
    )
    async with worker:
        yield worker
    conn = await asyncpg.connect(aioq_dsn)
    try:
        waiting = await PENDING_TASKS.rows(conn, aioq_registry.schema)
    finally:
        await conn.close()
    if unknown := sorted({w.task for w in waiting if aioq_registry.get(w.task) is None}):
        warnings.warn(
            f"aioq_worker's registry ({len(aioq_registry)} tasks) has no task"
            f" {', '.join(unknown)}, whose jobs it left waiting: {REGISTRY_FIX}",
            RegistryWarning,
            stacklevel=1,
        )
    if unserved := sorted({w.queue for w in waiting if w.queue not in queues}):
        warnings.warn(
            f"aioq_worker served the queues {', '.join(queues)} (its registry's tasks' own) and"
            f" left jobs waiting in {', '.join(unserved)}: a job deferred into another queue"
            " (options(queue=...)) needs a worker serving it, e.g."
            " aioq.Worker(dsn=aioq_dsn, registry=..., queues=[...])",
            RegistryWarning,
            stacklevel=1,
        )


class RegistryWarning(UserWarning):
    """aioq_worker left jobs it could not run: a registry or queue other than the app's."""


@pytest.fixture
def aioq_drain(aioq_dsn: str, aioq_registry: Registry) -> Drain:
    """``await aioq_drain()``: run every ready job, and those they defer; return each run."""

    def run(registry: Registry | None = None, /, **worker_options: Any) -> Awaitable[list[Ran]]:
        return drain(aioq_dsn, registry or aioq_registry, **worker_options)

    return run
