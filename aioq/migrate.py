"""Install and upgrade the schema from ``schema.sql``, in place and idempotently."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

from aioq import sql as q
from aioq.db import Connection, Executor
from aioq.errors import SchemaError
from aioq.sql.schema import INSTALLED_VERSION, LOCK_SCHEMA, RECORD_MIGRATION, SCHEMA_EXISTS

__all__ = (
    "Migration",
    "SchemaStatus",
    "check_installed",
    "install",
    "migrations",
    "ring_trigger_sql",
    "schema_sql",
    "status",
)

_MARKER = re.compile(r"^-- aioq:migration (\d+)\s*$", re.MULTILINE)
# The opt-in doorbell trigger for raw-SQL inserts: a region of the prologue that runs only when
# asked for (install(ring_trigger=True)).
_RING_TRIGGER = re.compile(
    r"^-- aioq:ring-trigger begin\s*$(.*?)^-- aioq:ring-trigger end\s*$", re.MULTILINE | re.DOTALL
)


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered block of ``schema.sql``."""

    version: int
    sql: str


@dataclass(frozen=True, slots=True)
class SchemaStatus:
    """What is installed in a schema and what would be applied."""

    schema: str
    installed: int
    latest: int

    @property
    def pending(self) -> list[int]:
        """The migration versions not yet applied."""
        return list(range(self.installed + 1, self.latest + 1))


def _source() -> str:
    return resources.files("aioq").joinpath("schema.sql").read_text(encoding="utf-8")


def _split(schema: str) -> tuple[str, list[Migration]]:
    text = _RING_TRIGGER.sub("", _source().replace("{{schema}}", q.quote_schema(schema)))
    parts = _MARKER.split(text)
    prologue, rest = parts[0], parts[1:]
    found = [Migration(int(v), body) for v, body in zip(rest[::2], rest[1::2], strict=True)]
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise SchemaError("schema.sql migrations must be numbered 1, 2, 3, ... in order")
    return prologue, found


def migrations(schema: str = q.DEFAULT_SCHEMA) -> list[Migration]:
    """Return the migrations of ``schema.sql`` rendered for a schema."""
    return _split(schema)[1]


def schema_sql(schema: str = q.DEFAULT_SCHEMA) -> str:
    """Return the full DDL for a schema, as ``aioq schema sql`` prints it: what ``install``
    applies (the opt-in doorbell trigger apart: :func:`ring_trigger_sql`)."""
    return _RING_TRIGGER.sub("", _source().replace("{{schema}}", q.quote_schema(schema)))


def ring_trigger_sql(schema: str = q.DEFAULT_SCHEMA) -> str:
    """Return the DDL of the opt-in doorbell trigger, as ``aioq schema sql --ring-trigger``
    prints it: jobs inserted with raw SQL then ring the doorbell like aioq's own inserts.
    Idempotent; it needs the schema installed."""
    found = _RING_TRIGGER.search(_source().replace("{{schema}}", q.quote_schema(schema)))
    if found is None:  # pragma: no cover - schema.sql always has it
        raise SchemaError("schema.sql has no ring-trigger region")
    return found.group(1).strip() + "\n"


async def _installed(conn: Executor, schema: str) -> int:
    table = f"{q.quote_schema(schema)}.migrations"
    if not await SCHEMA_EXISTS.row(conn, schema, table):
        return 0
    return await INSTALLED_VERSION.row(conn, schema) or 0


async def status(conn: Connection, schema: str = q.DEFAULT_SCHEMA) -> SchemaStatus:
    """Report the installed and latest schema versions."""
    return SchemaStatus(schema, await _installed(conn, schema), len(migrations(schema)))


async def install(
    conn: Connection, schema: str = q.DEFAULT_SCHEMA, *, ring_trigger: bool = False
) -> list[int]:
    """Apply ``schema.sql`` to a schema; return the migration versions applied now.

    Safe to run concurrently and repeatedly: it takes a transaction-level advisory lock
    and applies only the migrations not yet recorded. Raises :class:`SchemaError` when the
    role may not create or alter the schema (it needs the owner, not the application's grants).
    With ``ring_trigger``, it also installs the opt-in doorbell trigger (:func:`ring_trigger_sql`)
    for jobs other programs insert with raw SQL.
    """
    prologue, found = _split(schema)
    applied: list[int] = []
    try:
        async with conn.transaction():
            await LOCK_SCHEMA.run(conn, schema, q.channel_name(schema))
            await conn.execute(prologue)
            current = await _installed(conn, schema)
            for migration in found[current:]:
                await conn.execute(migration.sql)
                await RECORD_MIGRATION.run(conn, schema, migration.version)
                applied.append(migration.version)
            if ring_trigger:
                await conn.execute(ring_trigger_sql(schema))
    except asyncpg.InsufficientPrivilegeError as exc:
        # An application role with only the DML grants lands here; say who can do it.
        raise SchemaError(
            f"cannot install or upgrade schema {schema!r}: {exc}; run it as the schema's owner"
            " (or, for a first install, a role that may create schemas in this database)"
        ) from exc
    return applied


async def check_installed(conn: Executor, schema: str = q.DEFAULT_SCHEMA) -> None:
    """Raise :class:`SchemaError` unless the schema is installed at the version this aioq needs.

    A worker calls it at start-up, so that a missing or outdated schema is one clear error
    that says what to run, instead of a loop of failing statements. A role that may not read
    the migrations table (an application role with only the documented grants) is checked for
    the jobs table alone.
    """
    quoted = q.quote_schema(schema)
    if not await SCHEMA_EXISTS.row(conn, schema, f"{quoted}.jobs"):
        raise SchemaError(
            f"the aioq schema {schema!r} is not installed in this database:"
            f" run: aioq schema apply{_flag(schema)} (or await aioq.install(conn))"
        )
    try:
        installed = await _installed(conn, schema)
    except asyncpg.InsufficientPrivilegeError:
        return
    latest = len(migrations(schema))
    if installed < latest:
        raise SchemaError(
            f"the aioq schema {schema!r} is at version {installed}, this aioq needs {latest}:"
            f" run: aioq schema apply{_flag(schema)}"
        )
    if installed > latest:
        raise SchemaError(
            f"the aioq schema {schema!r} is at version {installed}, newer than this aioq"
            f" knows ({latest}): upgrade aioq-pg on this host"
        )


def _flag(schema: str) -> str:
    return "" if schema == q.DEFAULT_SCHEMA else f" --schema {schema}"
