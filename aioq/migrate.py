"""Install and upgrade the schema from its migrations, in place and idempotently.

The DDL lives in files (docs/architecture.md, "Tables"): ``aioq/sql/migrations/prologue.sql``
runs every time (the schema and its ``migrations`` table, idempotent), each
``aioq/sql/migrations/NNN_name.sql`` is migration NNN, and ``aioq/sql/ring_trigger.sql`` is the
opt-in doorbell trigger. In every file ``@schema`` stands for the quoted schema name, as in the
statements of :mod:`aioq.sql` (one placeholder syntax for all of aioq's SQL). The
repository's top-level ``schema.sql`` is the schema they build, for reading; a test holds it
equal to a fresh install.

``install`` applies the migrations not yet recorded in ``<schema>.migrations``. ``schema_sql``
renders the same migrations as one SQL script for a migration tool (psql, Alembic, Flyway,
Django): each migration followed by the row that records it, after a guard that refuses to run
on a schema at another version than the script starts from. A schema applied by hand without
those rows (an older ``aioq schema sql``, or the migration files run in order) is recognised by
``install``, which records the migrations already applied instead of failing on their tables.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

import asyncpg

from aioq import sql as q
from aioq.db import Connection, Executor
from aioq.errors import SchemaError
from aioq.sql.schema import (
    INSTALLED_VERSION,
    LOCK_SCHEMA,
    RECORD_MIGRATION,
    SCHEMA_EXISTS,
    script_guard,
    script_record,
)

__all__ = (
    "MIGRATIONS",
    "SCHEMA_TOKEN",
    "Migration",
    "SchemaStatus",
    "check_installed",
    "install",
    "latest_version",
    "migrations",
    "read_migrations",
    "ring_trigger_sql",
    "schema_sql",
    "status",
)

SCHEMA_TOKEN = "@schema"
"""The placeholder for the schema name in the DDL files, replaced by the quoted, validated
name: the statements' own marker (aioq.sql), never Python format syntax. The files are SQL with
this one token; a ``@`` followed by a letter is nothing else in them."""

_TOKEN = re.compile(re.escape(SCHEMA_TOKEN) + r"\b")

MIGRATIONS: Traversable = resources.files("aioq") / "sql" / "migrations"
"""The directory of the migration files (and of the prologue), inside the installed package."""

_PROLOGUE = "prologue.sql"
_RING_TRIGGER = "ring_trigger.sql"  # beside the migrations' directory: not one of them
# Migration NNN: three digits or more, then what it does.
_FILE = re.compile(r"(\d{3,})_([a-z][a-z0-9_]*)\.sql")


@dataclass(frozen=True, slots=True)
class Migration:
    """One migration: its version, its name (what it does), its SQL for one schema."""

    version: int
    name: str
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


def read_migrations(directory: Traversable = MIGRATIONS) -> list[Migration]:
    """Read the migration files of ``directory`` (``NNN_name.sql``, numbered 1, 2, 3, ...),
    unrendered: their SQL still has :data:`SCHEMA_TOKEN`. Raise :class:`SchemaError` naming
    the file that is misnamed, numbered twice or missing."""
    found: dict[int, Migration] = {}
    for entry in directory.iterdir():
        if not entry.name.endswith(".sql") or entry.name == _PROLOGUE:
            continue
        named = _FILE.fullmatch(entry.name)
        if named is None:
            raise SchemaError(
                f"{entry.name}: a migration file is named NNN_what_it_does.sql (the version in"
                " three digits or more, then lower-case letters, digits and _)"
            )
        version, name = int(named[1]), named[2]
        if version in found:
            raise SchemaError(
                f"{entry.name}: migration {version} is already"
                f" {version:03d}_{found[version].name}.sql"
            )
        found[version] = Migration(version, name, entry.read_text(encoding="utf-8"))
    missing = sorted(set(range(1, max(found, default=0) + 1)) - set(found))
    if missing:
        raise SchemaError(
            f"migrations are numbered 1, 2, 3, ... without gaps: no file for {missing[0]}"
            f" ({missing[0]:03d}_*.sql) in {directory}"
        )
    return [found[version] for version in sorted(found)]


@functools.cache
def _templates() -> tuple[str, tuple[Migration, ...]]:
    """The prologue and the migrations, read once per process."""
    prologue = (MIGRATIONS / _PROLOGUE).read_text(encoding="utf-8")
    found = tuple(read_migrations())
    if not found:  # pragma: no cover - a package installed without its data files
        raise SchemaError(f"no migration files in {MIGRATIONS}: reinstall aioq-pg")
    return prologue, found


def _render(template: str, schema: str) -> str:
    quoted = q.quote_schema(schema)
    return _TOKEN.sub(lambda _: quoted, template)


def _split(schema: str) -> tuple[str, list[Migration]]:
    prologue, found = _templates()
    return _render(prologue, schema), [
        Migration(m.version, m.name, _render(m.sql, schema)) for m in found
    ]


def migrations(schema: str = q.DEFAULT_SCHEMA) -> list[Migration]:
    """Return the migrations rendered for a schema, in order."""
    return _split(schema)[1]


def latest_version() -> int:
    """Return the version the migrations bring a schema to: the last migration's number."""
    return len(_templates()[1])


def schema_sql(
    schema: str = q.DEFAULT_SCHEMA, *, from_version: int = 0, to_version: int | None = None
) -> str:
    """Return the SQL that upgrades a schema from ``from_version`` (0: none) to ``to_version``
    (default: the latest), recording each migration, as ``aioq schema sql`` prints it.

    For a migration tool: run it once, in one transaction (``psql --single-transaction``; an
    Alembic or Django migration is one). It starts with a guard that raises unless the schema
    is at ``from_version``; then ``aioq schema status`` reports ``to_version`` and workers start.
    Pin both versions in a migration file, so that a later aioq-pg does not change what it runs.
    """
    latest = latest_version()
    to = latest if to_version is None else to_version
    if not 0 <= from_version <= to <= latest:
        raise SchemaError(
            f"cannot upgrade from version {from_version} to {to}: the versions go from 0"
            f" (nothing installed) to {latest}, the latest this aioq knows, upwards"
        )
    prologue, found = _split(schema)
    # The prologue's own header (how install() runs it) gives way to what this script is.
    statements = _without_header(prologue)
    head = (
        f"-- aioq schema {schema}: from version {from_version} to {to}.\n"
        "-- Run it once, in one transaction; each migration records its version in"
        f" {q.quote_schema(schema)}.migrations.\n\n"
    )
    parts = [head + statements + "\n\n" + script_guard(schema, from_version)]
    for migration in found[from_version:to]:
        body = migration.sql.strip("\n")
        record = script_record(schema, migration.version)
        parts.append(f"-- aioq:migration {migration.version}\n\n{body}\n\n{record}\n")
    return "\n".join(parts)


def ring_trigger_sql(schema: str = q.DEFAULT_SCHEMA) -> str:
    """Return the DDL of the opt-in doorbell trigger, as ``aioq schema sql --ring-trigger``
    prints it: jobs inserted with raw SQL then ring the doorbell like aioq's own inserts.
    Idempotent; it needs the schema installed."""
    template = (resources.files("aioq") / "sql" / _RING_TRIGGER).read_text(encoding="utf-8")
    return _render(template, schema).strip() + "\n"


def _without_header(text: str) -> str:
    """A file's SQL from its first statement: the comment block that opens it dropped."""
    lines = text.strip("\n").splitlines()
    first = next(i for i, line in enumerate(lines) if line and not line.startswith("--"))
    return "\n".join(lines[first:])


async def _installed(conn: Executor, schema: str) -> int:
    table = f"{q.quote_schema(schema)}.migrations"
    if not await SCHEMA_EXISTS.row(conn, schema, table):
        return 0
    return await INSTALLED_VERSION.row(conn, schema) or 0


async def status(conn: Connection, schema: str = q.DEFAULT_SCHEMA) -> SchemaStatus:
    """Report the installed and latest schema versions."""
    return SchemaStatus(schema, await _installed(conn, schema), latest_version())


async def install(
    conn: Connection, schema: str = q.DEFAULT_SCHEMA, *, ring_trigger: bool = False
) -> list[int]:
    """Apply the migrations to a schema; return the migration versions applied now.

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
            if current == 0 and await SCHEMA_EXISTS.row(
                conn, schema, f"{q.quote_schema(schema)}.jobs"
            ):
                current = await _version_by_hand(conn, found)
                for migration in found[:current]:
                    await RECORD_MIGRATION.run(conn, schema, migration.version)
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


# What a migration's DDL raises on a schema that already has its objects.
_ALREADY_THERE = (
    asyncpg.DuplicateTableError,
    asyncpg.DuplicateObjectError,
    asyncpg.DuplicateColumnError,
    asyncpg.DuplicateFunctionError,
)


async def _version_by_hand(conn: Connection, found: list[Migration]) -> int:
    """The version of a schema applied without its rows: the last migration whose DDL finds
    its objects already there.

    Each migration is tried alone under a savepoint that is always rolled back, so nothing of
    it stays. One that creates a table, a column, an index or a function raises a "duplicate"
    error when applied already. One that only replaces what exists (a function body), or fails
    for another reason (it needs what a later one changed, or an earlier one not there), says
    nothing: the later migrations decide, and if none does it runs again, as is harmless for a
    migration that creates nothing.
    """
    version = 0
    for migration in found:
        try:
            async with conn.transaction():  # a savepoint
                await conn.execute(migration.sql)
                raise _Rollback
        except _ALREADY_THERE:
            version = migration.version
        except (_Rollback, asyncpg.PostgresError):
            pass
    return version


class _Rollback(Exception):
    """Leave a savepoint, undoing what ran inside it."""


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
    latest = latest_version()
    if installed == 0:
        raise SchemaError(
            f"the aioq schema {schema!r} has its tables but no recorded version (applied by"
            f" hand from schema.sql?): run: aioq schema apply{_flag(schema)}, which records the"
            " migrations already there and applies the rest"
        )
    if installed < latest:
        raise SchemaError(
            f"the aioq schema {schema!r} is at version {installed}, this aioq needs {latest}:"
            f" run: aioq schema apply{_flag(schema)} (where a migration tool owns the schema,"
            f" apply what aioq schema sql --from {installed}{_flag(schema)} prints)"
        )
    if installed > latest:
        raise SchemaError(
            f"the aioq schema {schema!r} is at version {installed}, newer than this aioq"
            f" knows ({latest}): upgrade aioq-pg on this host"
        )


def _flag(schema: str) -> str:
    return "" if schema == q.DEFAULT_SCHEMA else f" --schema {schema}"
