"""The schema owned by a migration tool: `aioq schema sql` (piped to psql, or in an Alembic
revision) records the versions it applies, `--from N` prints an upgrade, and a schema applied
by hand without those records is recognised by `aioq schema apply`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from procs import aioq_cli, spawner
from waits import wait_for

import aioq
from aioq import migrate
from aioq.dev.pgbin import find_binaries
from aioq.errors import ServerError

LATEST = migrate.latest_version()
SCHEMA = "tooled"


def run(dsn: str, coro: Any) -> Any:
    async def go() -> Any:
        conn = await asyncpg.connect(dsn)
        try:
            return await coro(conn)
        finally:
            await conn.close()

    return asyncio.run(go())


def _beside_the_server(name: str) -> str | None:
    """A program of the PostgreSQL installation the test harness runs its server from."""
    try:
        found = find_binaries() / name
    except ServerError:  # no installation here (the tests' server came from AIOQ_TEST_DSN)
        return None
    return str(found) if found.is_file() else None


def psql(dsn: str, sql: str) -> subprocess.CompletedProcess[str]:
    """Pipe a script to psql in one transaction, stopping at the first error, as documented."""
    binary = shutil.which("psql") or _beside_the_server("psql")
    if binary is None:
        pytest.skip(
            "psql (PostgreSQL's client) is not installed: the documented `aioq schema sql | psql`"
            " cannot be run here"
        )
    return subprocess.run(
        [binary, "-X", "-q", "-v", "ON_ERROR_STOP=1", "--single-transaction", "-d", dsn],
        input=sql,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def status(dsn: str) -> dict[str, Any]:
    shown = aioq_cli(dsn, "schema", "status", "--schema", SCHEMA, "--json")
    return json.loads(shown.stdout)  # type: ignore[no-any-return]


def sql(*flags: str) -> str:
    printed = aioq_cli(None, "schema", "sql", "--schema", SCHEMA, *flags)
    assert printed.returncode == 0, printed
    return printed.stdout


def test_schema_sql_piped_to_psql_records_its_version_and_the_worker_starts(
    dsn: str, tmp_path: Path
) -> None:
    applied = psql(dsn, sql())
    assert applied.returncode == 0, applied
    assert status(dsn) == {"schema": SCHEMA, "installed": LATEST, "latest": LATEST, "pending": []}
    again = aioq_cli(dsn, "schema", "apply", "--schema", SCHEMA)
    assert again.returncode == 0, again
    assert again.stdout.strip() == f"schema {SCHEMA}: up to date (version {LATEST})"
    # The same script twice stops at its guard, naming the version, before any DDL.
    twice = psql(dsn, sql())
    assert twice.returncode != 0
    assert f"the aioq schema '{SCHEMA}' is at version {LATEST}, this SQL upgrades from" in (
        twice.stderr
    )
    assert [line for line in twice.stderr.splitlines() if line.startswith("ERROR")] == [
        next(line for line in twice.stderr.splitlines() if "this SQL upgrades" in line)
    ]

    # A worker checks the version at start, and serves.
    (tmp_path / "tasks.py").write_text(
        "import aioq\nregistry = aioq.Registry(schema='tooled')\n"
        "@registry.task(name='hello')\ndef hello() -> None: ...\n"
    )
    with spawner(dsn) as spawn:
        worker = spawn("worker", "tasks:registry", "--schema", SCHEMA, cwd=tmp_path)
        wait_for(
            lambda: run(
                dsn,
                lambda c: c.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE"
                    " 'aioq listener %' AND datname = current_database()"
                ),
            ),
            "the worker's listener",
        )
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr
    assert "serving queues default" in stderr


def test_schema_sql_from_n_upgrades_from_that_version(dsn: str) -> None:
    older = psql(dsn, sql("--to", str(LATEST - 1)))
    assert older.returncode == 0, older
    assert status(dsn)["pending"] == [LATEST]
    upgrade = sql("--from", str(LATEST - 1))
    assert re.findall(r"-- aioq:migration (\d+)\n", upgrade) == [str(LATEST)]
    wrong = psql(dsn, sql("--from", str(LATEST - 2)))
    assert wrong.returncode != 0
    assert f"is at version {LATEST - 1}, this SQL upgrades from version {LATEST - 2}" in (
        wrong.stderr
    )
    done = psql(dsn, upgrade)
    assert done.returncode == 0, done
    assert status(dsn)["installed"] == LATEST
    assert sql("--from", str(LATEST)).count("-- aioq:migration") == 0  # nothing to do
    bad = aioq_cli(None, "schema", "sql", "--from", str(LATEST + 1))
    assert bad.returncode == 2
    assert f"to {LATEST}, the latest this aioq knows" in bad.stderr


def by_hand(up_to: int) -> str:
    """schema.sql's migrations up to a version, as a tool applies the file: no version rows."""
    prologue = sql("--to", "0")
    return prologue + "".join(m.sql for m in migrate.migrations(SCHEMA)[:up_to])


@pytest.mark.parametrize("up_to", [LATEST, LATEST - 1, 8])
def test_a_schema_applied_by_hand_is_recognised(dsn: str, up_to: int) -> None:
    applied = psql(dsn, by_hand(up_to))
    assert applied.returncode == 0, applied
    assert status(dsn)["installed"] == 0
    run(dsn, lambda c: c.execute(f"INSERT INTO {SCHEMA}.jobs (task) VALUES ('kept')"))
    # The worker's check says what to do ...
    checked = run(dsn, lambda c: _check(c))
    assert "has its tables but no recorded version (applied by hand" in checked
    # ... and `aioq schema apply` records what is there and applies the rest, keeping the data.
    adopt = aioq_cli(dsn, "schema", "apply", "--schema", SCHEMA, "--json")
    assert adopt.returncode == 0, adopt
    assert json.loads(adopt.stdout)["version"] == LATEST
    rerun = set(json.loads(adopt.stdout)["applied"])
    assert set(range(up_to + 1, LATEST + 1)) <= rerun
    # What was there is not applied again (only a migration that creates nothing may be).
    creating = {
        m.version
        for m in migrate.migrations(SCHEMA)
        if re.search(r"CREATE (UNIQUE )?(TABLE|INDEX|TRIGGER|FUNCTION)|ADD COLUMN", m.sql)
    }
    assert not rerun & {v for v in creating if v <= up_to}
    assert status(dsn)["installed"] == LATEST
    assert run(dsn, lambda c: c.fetchval(f"SELECT task FROM {SCHEMA}.jobs")) == "kept"


async def _check(conn: asyncpg.Connection) -> str:
    try:
        await migrate.check_installed(conn, SCHEMA)
    except aioq.errors.SchemaError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize(
    ("project", "driver"), [("alembic_project", "psycopg"), ("alembic_async_project", "asyncpg")]
)
def test_the_alembic_recipe_installs_the_schema_and_downgrades(
    dsn: str, project: str, driver: str
) -> None:
    """docs/operations-and-cli.md's revisions, run by the real alembic on a database without
    aioq's schema: installed at the version it pins, recorded; the downgrade drops it. The
    async env's (asyncpg) is the one a plain `op.execute(schema_sql(...))` fails on."""
    pytest.importorskip("alembic")
    alembic_dir = Path(__file__).parent / project
    revision = alembic_dir / "versions" / "a10c0001_aioq_schema.py"
    pinned = int(re.findall(r"to_version=(\d+)", revision.read_text())[0])
    run(dsn, lambda c: c.execute('DROP SCHEMA "aioq" CASCADE'))
    url = dsn.replace("postgresql://", f"postgresql+{driver}://", 1)

    def alembic(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "alembic", "-c", str(alembic_dir / "alembic.ini"), *args],
            env={**os.environ, "ALEMBIC_URL": url},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    upgraded = alembic("upgrade", "head")
    assert upgraded.returncode == 0, upgraded.stderr
    shown = json.loads(aioq_cli(dsn, "schema", "status", "--json").stdout)
    assert shown["installed"] == pinned
    assert shown["pending"] == list(range(pinned + 1, LATEST + 1))
    downgraded = alembic("downgrade", "base")
    assert downgraded.returncode == 0, downgraded.stderr
    assert run(dsn, lambda c: c.fetchval("SELECT to_regnamespace('aioq') IS NULL")) is True
