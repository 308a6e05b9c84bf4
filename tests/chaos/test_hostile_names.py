"""Scenario 8 (names): hostile schema, queue and task names.

Schema names that try SQL injection (or are merely not plain identifiers) are refused with a
ConfigError -- one line and exit 2 in the CLI -- before any SQL runs; queue and task names are
bind parameters, stored verbatim and inert, and a worker process serves them; names
PostgreSQL cannot store (NUL, lone surrogates) are refused up front, leaving the caller's
transaction untouched.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest
from harness import (
    RUNS_TABLE,
    STOP_TIMEOUT,
    WorkerProcess,
    fetch,
    value,
    wait_for,
    write_tasks,
)
from procs import aioq_cli, assert_one_line_error

import aioq

pytestmark = pytest.mark.chaos

registry = aioq.Registry()


@registry.task(name="names.echo")
async def echo(**values: object) -> None: ...


# --- hostile names ---------------------------------------------------------------------------

INJECTIONS = [
    'x"; DROP TABLE aioq.jobs; --',
    "x'; DROP TABLE aioq.jobs; --",
    "aioq; DROP SCHEMA aioq CASCADE",
    "aioq.jobs",
    'aioq"',
    "Aioq",  # valid, and quoted it is not aioq: a schema that does not exist
    "схема",
    "schéma",
    "1aioq",
    "",
    "a" * 64,
    "aioq\x00",
    "aioq ",
]


def test_schema_names_that_try_injection_are_refused(dsn: str) -> None:
    tables = "SELECT count(*) FROM pg_tables WHERE schemaname = 'aioq'"
    before = value(dsn, tables)
    for schema in INJECTIONS:
        if schema == "Aioq":
            continue  # a valid identifier: quoted, it is a different, absent schema
        with pytest.raises(aioq.errors.ConfigError, match="schema") as info:
            aioq.Registry(schema=schema)
        assert repr(schema) in str(info.value)
        with pytest.raises(aioq.errors.ConfigError, match="schema"):
            aioq.Worker(dsn=dsn, schema=schema)
        with pytest.raises(aioq.errors.ConfigError, match="schema"):
            aioq.WorkerConfig(schema=schema)
        with pytest.raises(aioq.errors.ConfigError, match="schema"):
            aioq.admin.schema_sql(schema)

    async def install_and_stats() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            for schema in INJECTIONS[:3]:
                with pytest.raises(aioq.errors.ConfigError, match="schema"):
                    await aioq.install(conn, schema=schema)
                with pytest.raises(aioq.errors.ConfigError, match="schema"):
                    await aioq.admin.stats(conn, schema=schema)
        finally:
            await conn.close()

    asyncio.run(install_and_stats())
    # The CLI: one line, exit 2 (NUL cannot be in argv). Every kind of command with the first
    # name, then the commands in turn with the others.
    commands = (["schema", "apply"], ["stats"], ["jobs", "list"], ["defer", "t"])
    names = [s for s in INJECTIONS if "\x00" not in s and s not in ("", "Aioq")]
    cases = [(c, names[0]) for c in commands]
    cases += [(commands[i % len(commands)], name) for i, name in enumerate(names[1:])]
    for command, schema in cases:
        result = aioq_cli(dsn, *command, "--schema", schema, timeout=STOP_TIMEOUT)
        assert_one_line_error(result, "schema", "is not a valid schema name")
    worker = aioq_cli(dsn, "worker", "aioq", "--schema", INJECTIONS[0], timeout=STOP_TIMEOUT)
    assert_one_line_error(worker, "is not a valid schema name")
    # "Aioq" is valid and distinct: quoted, it names a schema that does not exist.
    missing = aioq_cli(dsn, "stats", "--schema", "Aioq", timeout=STOP_TIMEOUT)
    assert_one_line_error(missing, "aioq schema apply")
    assert value(dsn, tables) == before
    assert value(dsn, "SELECT count(*) FROM aioq.jobs") == 0


HOSTILE_TASKS = """
registry = aioq.Registry()

for _name in (
    "x'; DROP TABLE aioq.jobs; --",
    'x"); DROP SCHEMA aioq CASCADE; --',
    "задача ☃ 😀",
    "$1::text",
):
    async def _run(name: str = _name) -> None:
        await record("ok:" + name)

    registry.task(name=_name)(_run)
"""

HOSTILE_QUEUES = [
    "x'); DROP TABLE aioq.jobs; --",
    'q"uote',
    "очередь ☃ 😀",
    "$1",
    "%s%s%n",
    "q" * 200,
]


def test_queue_and_task_names_that_try_injection_are_inert(dsn: str, tmp_path: Path) -> None:
    fetch(dsn, RUNS_TABLE)
    tables = "SELECT count(*) FROM pg_tables WHERE schemaname = 'aioq'"
    tables_before = value(dsn, tables)
    module = write_tasks(tmp_path, "hostiletasks", HOSTILE_TASKS)
    sys.path.insert(0, str(tmp_path))
    try:
        tasks = __import__(module)
    finally:
        sys.path.remove(str(tmp_path))
    names = sorted(tasks.registry)

    async def defer_all() -> list[int]:
        conn = await asyncpg.connect(dsn)
        try:
            ids = []
            async with conn.transaction():
                for i, name in enumerate(names):
                    queue = HOSTILE_QUEUES[i % len(HOSTILE_QUEUES)]
                    ids.append(await tasks.registry.get(name).options(queue=queue).defer(conn))
                for queue in HOSTILE_QUEUES:
                    keyed = tasks.registry.get(names[0]).options(queue=queue, unique_key=queue)
                    ids.append(await keyed.defer(conn))
            return ids
        finally:
            await conn.close()

    ids = asyncio.run(defer_all())
    cli = aioq_cli(dsn, "defer", names[1], "--queue", HOSTILE_QUEUES[0], timeout=STOP_TIMEOUT)
    assert cli.returncode == 0, cli.stderr
    ids.append(int(cli.stdout))
    stored = fetch(dsn, "SELECT task, queue, unique_key FROM aioq.jobs ORDER BY id")
    assert {r["task"] for r in stored} == set(names)  # verbatim
    assert {r["queue"] for r in stored} == set(HOSTILE_QUEUES)
    assert {r["unique_key"] for r in stored} - {None} == set(HOSTILE_QUEUES)
    listed = aioq_cli(
        dsn, "jobs", "list", "--task", names[0], "--queue", HOSTILE_QUEUES[0], timeout=STOP_TIMEOUT
    )
    assert listed.returncode == 0, listed.stderr

    queues = [arg for q in HOSTILE_QUEUES for arg in ("--queue", q)]
    with WorkerProcess(
        f"{module}:registry", *queues, "--poll-interval", "0.5",
        dsn=dsn, cwd=tmp_path, env={"CHAOS_RECORD_DSN": dsn},
    ) as worker:  # fmt: skip
        wait_for(lambda: len(run_counts_any(dsn)) == len(ids), "every job", on_timeout=worker.log)
        assert worker.stop() == 0, worker.log()[-3000:]
    assert value(dsn, "SELECT count(*) FROM aioq.jobs") == 0
    assert set(run_counts_any(dsn).values()) == {1}
    assert value(dsn, tables) == tables_before  # no table was created or dropped


def run_counts_any(dsn: str) -> dict[int, int]:
    rows = fetch(dsn, "SELECT job_id, count(*) FROM public.chaos_runs GROUP BY job_id")
    return {r[0]: r[1] for r in rows}


UNSTORABLE = ["a\x00b", "\x00", "\ud800", "ok\udfff"]


def test_names_postgresql_cannot_store_are_refused_up_front(dsn: str, tmp_path: Path) -> None:
    async def attempt() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            async with conn.transaction():
                for bad in UNSTORABLE:
                    with pytest.raises(aioq.errors.ConfigError, match="queue"):
                        echo.options(queue=bad)
                    with pytest.raises(aioq.errors.ConfigError, match="unique_key"):
                        echo.options(unique_key=bad)
                    with pytest.raises(aioq.errors.ConfigError, match="name"):
                        registry.task(name=bad)(lambda: None)
                    with pytest.raises(aioq.errors.ConfigError, match="queues"):
                        aioq.Worker(dsn=dsn, queues=["default", bad])
                # The caller's transaction was never touched.
                assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 0
        finally:
            await conn.close()

    asyncio.run(attempt())
    # From a shell, undecodable bytes reach argv as lone surrogates.
    for args in ([b"\xff"], [b"t", b"--queue", b"q\xff"]):
        result = subprocess.run(
            [sys.executable.encode(), b"-m", b"aioq", b"defer", *args],
            capture_output=True,
            env={"AIOQ_DSN": dsn, "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
            timeout=60,
            check=False,
        )
        decoded = subprocess.CompletedProcess(
            result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
        )
        assert_one_line_error(decoded, "lone surrogate")
    assert value(dsn, "SELECT count(*) FROM aioq.jobs") == 0
