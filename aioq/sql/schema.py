"""The migrations' bookkeeping (aioq.migrate applies aioq/sql/migrations/, the DDL's history)."""

from __future__ import annotations

from aioq.sql import Statement, boolean, integer, nothing, render

__all__ = (
    "DROP_SCHEMA",
    "INSTALLED_VERSION",
    "LOCK_SCHEMA",
    "RECORD_MIGRATION",
    "SCHEMA_EXISTS",
    "create_database",
    "drop_database",
    "script_guard",
    "script_record",
)

# $1 a qualified table name.
SCHEMA_EXISTS = Statement("SELECT to_regclass($1) IS NOT NULL", boolean)

INSTALLED_VERSION = Statement("SELECT coalesce(max(version), 0) FROM {s}.migrations", integer)

# $1 the schema's lock key: installs of one schema take turns.
LOCK_SCHEMA = Statement("SELECT pg_advisory_xact_lock(hashtext($1))", nothing)

RECORD_MIGRATION = Statement("INSERT INTO {s}.migrations (version) VALUES ($1)", nothing)

# A schema and everything in it (the pytest plugin's fresh schema per test).
DROP_SCHEMA = Statement("DROP SCHEMA IF EXISTS {s} CASCADE", nothing)


def _database(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def create_database(name: str) -> str:
    """CREATE DATABASE for a throwaway database (tests, the pytest plugin): not a bind
    parameter, so the name is quoted here."""
    return f"CREATE DATABASE {_database(name)}"


def drop_database(name: str) -> str:
    """DROP DATABASE of a throwaway database, closing its sessions."""
    return f"DROP DATABASE IF EXISTS {_database(name)} WITH (FORCE)"


# The script `aioq schema sql` prints (aioq.migrate.schema_sql) runs without bind parameters:
# the versions are integers, the schema name admits letters, digits and _ only.


def script_guard(schema: str, from_version: int) -> str:
    """A statement that raises unless the schema's recorded version is ``from_version``."""
    return render(
        f"""DO $aioq$
DECLARE installed integer := (SELECT coalesce(max(version), 0) FROM {{s}}.migrations);
BEGIN
    IF installed <> {int(from_version)} THEN
        RAISE EXCEPTION 'the aioq schema ''{schema}'' is at version %%, this SQL upgrades from'
            ' version {int(from_version)} (print the right one: aioq schema sql --from %%)',
            installed, installed;
    END IF;
END
$aioq$;
""",
        schema,
    ).replace("%%", "%")


def script_record(schema: str, version: int) -> str:
    """The statement that records a migration as applied."""
    return render(f"INSERT INTO {{s}}.migrations (version) VALUES ({int(version)});", schema)
