"""A worker checks its database at start-up: no schema, a wrong version, no server.

Each case used to loop or pass silently: ``run_until_idle()`` logged errors forever,
``async with Worker(...)`` entered as if all was well, ``aioq worker`` printed a thousand lines of
tracebacks, and ``async with`` raised an ExceptionGroup where ``run()`` raised the plain error.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import anyio
import asyncpg
import pytest
from db import run_sql, with_database
from procs import aioq_cli, assert_one_line_error

import aioq
from aioq import migrate

HANG_GUARD = 30.0
LATEST = len(migrate.migrations())
TASKS = "import aioq\n\n\n@aioq.task\nasync def noop() -> None: ...\n"


@pytest.fixture
def empty_dsn(admin_dsn: str) -> Iterator[str]:
    """A DSN of a fresh database without the aioq schema."""
    name = f"aioq_empty_{secrets.token_hex(6)}"
    run_sql(admin_dsn, f'CREATE DATABASE "{name}"')
    yield with_database(admin_dsn, name)
    run_sql(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def unreachable_dsn() -> str:
    """A DSN of a port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/nowhere"


async def _start(worker: aioq.Worker, how: str) -> None:
    with anyio.fail_after(HANG_GUARD):
        if how == "run":
            await worker.run()
        elif how == "run_until_idle":
            await worker.run_until_idle()
        else:
            async with worker:
                pytest.fail("async with entered a worker that cannot serve")


HOWS = ("run", "run_until_idle", "async with")

STATES = {
    "missing": ([], "is not installed in this database: run: aioq schema apply"),
    "older": (
        [f"DELETE FROM aioq.migrations WHERE version = {LATEST}"],
        f"is at version {LATEST - 1}, this aioq needs {LATEST}: run: aioq schema apply (where a"
        f" migration tool owns the schema, apply what aioq schema sql --from {LATEST - 1} prints)",
    ),
    "by hand": (
        ["DELETE FROM aioq.migrations"],
        "has its tables but no recorded version (applied by hand from schema.sql?): run: aioq"
        " schema apply, which records the migrations already there and applies the rest",
    ),
    "newer": (
        ["INSERT INTO aioq.migrations (version) VALUES (999)"],
        "is at version 999, newer than this aioq knows",
    ),
}


@pytest.mark.anyio
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("state", sorted(STATES))
async def test_worker_refuses_to_start_without_the_right_schema(
    dsn: str, empty_dsn: str, how: str, state: str
) -> None:
    statements, expected = STATES[state]
    target = empty_dsn if state == "missing" else dsn
    conn = await asyncpg.connect(target)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()
    with pytest.raises(aioq.errors.SchemaError) as info:
        await _start(aioq.Worker(dsn=target, registry=aioq.Registry(), poll_interval=0.1), how)
    assert type(info.value) is aioq.errors.SchemaError  # plain, never inside an ExceptionGroup
    assert expected in str(info.value)


@pytest.mark.anyio
@pytest.mark.parametrize("how", HOWS)
async def test_worker_without_a_server_raises_the_plain_connection_error(
    unreachable_dsn: str, how: str
) -> None:
    with pytest.raises(ConnectionRefusedError) as info:
        await _start(aioq.Worker(dsn=unreachable_dsn, registry=aioq.Registry()), how)
    assert not isinstance(info.value, BaseExceptionGroup)


@pytest.mark.anyio
async def test_worker_starts_once_the_schema_is_applied(empty_dsn: str) -> None:
    registry = aioq.Registry()
    ran = anyio.Event()

    @registry.task(name="t.noop")
    async def noop() -> None:
        ran.set()

    conn = await asyncpg.connect(empty_dsn)
    try:
        assert await aioq.install(conn)  # every migration, from none
        await noop.defer(conn)
    finally:
        await conn.close()
    with anyio.fail_after(HANG_GUARD):
        await aioq.Worker(dsn=empty_dsn, registry=registry, poll_interval=0.1).run_until_idle()
    assert ran.is_set()


@pytest.mark.parametrize("processes", ["1", "2"])
def test_cli_worker_without_schema_exits_2_with_one_line(
    empty_dsn: str, tmp_path: Path, processes: str
) -> None:
    (tmp_path / "jobs_mod.py").write_text(TASKS)
    result = aioq_cli(empty_dsn, "worker", "jobs_mod", "--processes", processes, cwd=tmp_path)
    assert_one_line_error(result, "not installed", "run: aioq schema apply")


def test_cli_worker_with_an_outdated_schema_exits_2_with_one_line(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "jobs_mod.py").write_text(TASKS)
    run_sql(dsn, f"DELETE FROM aioq.migrations WHERE version = {LATEST}")
    result = aioq_cli(dsn, "worker", "jobs_mod", cwd=tmp_path)
    assert_one_line_error(
        result, f"version {LATEST - 1}", f"needs {LATEST}", "run: aioq schema apply"
    )
    run_sql(dsn, "DELETE FROM aioq.migrations")  # applied by hand: the same line says so
    result = aioq_cli(dsn, "worker", "jobs_mod", cwd=tmp_path)
    assert_one_line_error(result, "no recorded version", "run: aioq schema apply")


def test_cli_worker_without_a_server_exits_2_with_one_line(
    unreachable_dsn: str, tmp_path: Path
) -> None:
    (tmp_path / "jobs_mod.py").write_text(TASKS)
    result = aioq_cli(unreachable_dsn, "worker", "jobs_mod", cwd=tmp_path)
    assert_one_line_error(result, "cannot reach the database")
