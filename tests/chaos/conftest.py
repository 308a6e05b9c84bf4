"""Fixtures of the chaos suite: a work directory with the tasks module, databases, fleets."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from db import with_database
from harness import Sql, WorkerProcess, prepare, spawn_fleet

import aioq
from aioq.dev.server import EmbeddedPostgres, find_binaries
from aioq.errors import ServerError


@pytest.fixture(scope="module")
def own_server() -> Iterator[EmbeddedPostgres]:
    """An embedded server of this test module's own: its scenarios restart it or proxy it."""
    if os.environ.get("AIOQ_TEST_DSN"):
        try:
            find_binaries()
        except ServerError as exc:  # the suite may run against a server of the user's own
            pytest.skip(f"needs an embedded server of its own: {exc}")
    with EmbeddedPostgres(fsync=False) as pg:
        yield pg


@pytest.fixture
def own_dsn(own_server: EmbeddedPostgres) -> Iterator[str]:
    """A fresh database on the module's own server, schema installed."""
    name = f"aioq_chaos_{secrets.token_hex(4)}"
    admin = Sql(own_server.dsn)
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        admin.close()
    dsn = with_database(own_server.dsn, name)
    sql = Sql(dsn)
    try:
        sql._run(aioq.install)
    finally:
        sql.close()
    yield dsn
    admin = Sql(own_server.dsn)
    try:
        admin.retrying(lambda: admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.close()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The workers' working directory (the tasks module and their logs live here)."""
    return tmp_path


@pytest.fixture
def fleets() -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker fleets (``spawn_fleet``); whatever is left is killed at teardown."""
    started: list[WorkerProcess] = []

    def start(*args: object, **kwargs: object) -> WorkerProcess:
        fleet = spawn_fleet(*args, **kwargs)  # type: ignore[arg-type]
        started.append(fleet)
        return fleet

    yield start
    for fleet in started:
        fleet.kill()


@pytest.fixture
def open_sql(workdir: Path) -> Iterator[Callable[[str], Sql]]:
    """Open the test's connection to a database and create the executions table there."""
    opened: list[Sql] = []

    def open_(dsn: str) -> Sql:
        sql = Sql(dsn)
        opened.append(sql)
        prepare(sql, workdir)
        return sql

    yield open_
    for sql in opened:
        sql.close()
