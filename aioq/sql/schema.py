"""The migrations' bookkeeping (aioq.migrate applies aioq/sql/migrations/, the DDL's history)."""

from __future__ import annotations

from aioq.sql import Statement, boolean, integer, nothing, quote_identifier, script

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

# A qualified table name.
SCHEMA_EXISTS = Statement("SELECT to_regclass(:table) IS NOT NULL", boolean, ("table",))

INSTALLED_VERSION = Statement("SELECT coalesce(max(version), 0) FROM @schema.migrations", integer)

# The schema's lock key: installs of one schema take turns.
LOCK_SCHEMA = Statement("SELECT pg_advisory_xact_lock(hashtext(:key))", nothing, ("key",))

RECORD_MIGRATION = Statement(
    "INSERT INTO @schema.migrations (version) VALUES (:version)", nothing, ("version",)
)

# A schema and everything in it (the pytest plugin's fresh schema per test).
DROP_SCHEMA = Statement("DROP SCHEMA IF EXISTS @schema CASCADE", nothing)


def create_database(name: str) -> str:
    """CREATE DATABASE for a throwaway database (tests, the pytest plugin): not a bind
    parameter, so the name is quoted here."""
    return "CREATE DATABASE " + quote_identifier(name)


def drop_database(name: str) -> str:
    """DROP DATABASE of a throwaway database, closing its sessions."""
    return "DROP DATABASE IF EXISTS " + quote_identifier(name) + " WITH (FORCE)"


# The script `aioq schema sql` prints (aioq.migrate.schema_sql) runs without bind parameters:
# aioq.sql.script() writes its values as literals (the versions are integers, the schema name
# admits letters, digits and _ only).
_GUARD = """DO $aioq$
DECLARE installed integer := (SELECT coalesce(max(version), 0) FROM @schema.migrations);
BEGIN
    IF installed <> :from_version THEN
        RAISE EXCEPTION 'the aioq schema ''%'' is at version %, this SQL upgrades from'
            ' version % (print the right one: aioq schema sql --from %)',
            :schema_name, installed, :from_version, installed;
    END IF;
END
$aioq$;
"""

_RECORD = "INSERT INTO @schema.migrations (version) VALUES (:version);"


def script_guard(schema: str, from_version: int) -> str:
    """A statement that raises unless the schema's recorded version is ``from_version``."""
    return script(_GUARD, schema, from_version=int(from_version), schema_name=schema)


def script_record(schema: str, version: int) -> str:
    """The statement that records a migration as applied."""
    return script(_RECORD, schema, version=int(version))
