"""The schema's two forms: its history (aioq/sql/migrations/NNN_name.sql, applied in order) and
the schema as it is (the repository's schema.sql). The files are numbered 1, 2, 3, ... with
neither gap nor duplicate, and a fresh install through the migrations has exactly the catalog
that schema.sql gives a fresh database. `make schema` runs this file."""

from __future__ import annotations

import difflib
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg
import pytest
from db import with_database

import aioq
from aioq import migrate
from aioq.errors import SchemaError

ROOT = Path(__file__).parent.parent
SCHEMA_SQL = ROOT / "schema.sql"
MIGRATIONS = Path(aioq.__file__).parent / "sql" / "migrations"
LATEST = migrate.latest_version()


# --- the files -----------------------------------------------------------------------------


def numbered_files() -> dict[str, int]:
    """The migration files and their numbers, read from the names alone."""
    names = [
        p.name for p in MIGRATIONS.iterdir() if p.suffix == ".sql" and p.name != "prologue.sql"
    ]
    return {name: int(name.partition("_")[0]) for name in names}


def test_migration_files_are_numbered_without_gaps_or_duplicates() -> None:
    files = numbered_files()
    assert [n for n in files if not re.fullmatch(r"\d{3,}_[a-z][a-z0-9_]*\.sql", n)] == []
    versions = sorted(files.values())
    assert versions == list(range(1, len(versions) + 1)), "a gap or a number used twice"
    assert migrate.latest_version() == max(versions) == len(files)
    ordered = sorted(files, key=files.__getitem__)
    loaded = migrate.migrations()
    assert [f"{m.version:03d}_{m.name}.sql" for m in loaded] == ordered
    for migration in loaded:
        assert migration.sql.strip(), f"migration {migration.version} is empty"


def test_every_ddl_file_names_the_schema_by_the_one_placeholder() -> None:
    token = migrate.SCHEMA_TOKEN
    files = [*MIGRATIONS.glob("*.sql"), MIGRATIONS.parent / "ring_trigger.sql"]
    assert len(files) == LATEST + 2  # the migrations, the prologue, the ring trigger
    for path in files:
        text = path.read_text()
        assert token in text, f"{path.name} never names the schema"
        rest = re.sub(re.escape(token) + r"\b", "", text)
        # The statements' marker syntax (aioq.sql), and nothing else: no other @name, no
        # brace placeholder.
        assert not re.search(r"@[A-Za-z_]", rest), f"{path.name}: a misspelt placeholder"
        assert "{{" not in rest, f"{path.name}: a placeholder of another syntax"
        assert "}}" not in rest, f"{path.name}: a placeholder of another syntax"


def test_schema_sql_is_a_file_at_the_latest_version() -> None:
    assert SCHEMA_SQL.is_file()
    assert not SCHEMA_SQL.is_symlink()
    text = SCHEMA_SQL.read_text()
    header = text.split("\n\n")[0]
    assert set(re.findall(r"\bversion (\d+)", header)) == {str(LATEST)}  # it says which
    assert re.findall(r"generate_series\(1, (\d+)\)", text) == [str(LATEST)]


@pytest.mark.parametrize(
    ("files", "error"),
    [
        (["001_a.sql", "003_c.sql"], r"no file for 2 \(002_\*\.sql\)"),
        (["001_a.sql", "002_b.sql", "002_other.sql"], r"002_\w+\.sql: migration 2 is already"),
        (["001_a.sql", "2_b.sql"], r"2_b\.sql: a migration file is named NNN_what_it_does"),
        (["001_a.sql", "002_Add-B.sql"], r"002_Add-B\.sql: a migration file is named"),
    ],
    ids=["gap", "duplicate", "short number", "bad name"],
)
def test_the_loader_refuses_a_gap_a_duplicate_and_a_misnamed_file(
    tmp_path: Path, files: list[str], error: str
) -> None:
    (tmp_path / "prologue.sql").write_text("-- not a migration\n")
    (tmp_path / "notes.txt").write_text("not SQL: ignored\n")
    for name in files:
        (tmp_path / name).write_text("SELECT 1;\n")
    with pytest.raises(SchemaError, match=error):
        migrate.read_migrations(tmp_path)


def test_the_loader_reads_the_files_in_number_order(tmp_path: Path) -> None:
    for name in ("010_j.sql", "002_b.sql", "001_a.sql", *(f"{n:03d}_x.sql" for n in range(3, 10))):
        (tmp_path / name).write_text(f"-- {name}\n")
    found = migrate.read_migrations(tmp_path)
    assert [m.version for m in found] == list(range(1, 11))
    assert (found[1].name, found[1].sql, found[9].name) == ("b", "-- 002_b.sql\n", "j")


# --- the catalog ---------------------------------------------------------------------------

# What a schema is made of, read from the catalog, one query per kind of object; each row is
# (the object, what it is). Definitions come from PostgreSQL's own deparsers, so two spellings
# of one thing compare equal. $1 is the schema's oid.
CATALOG = {
    "relation": """
        SELECT c.relname,
               CASE c.relkind WHEN 'r' THEN 'table' WHEN 'i' THEN 'index' WHEN 'S' THEN 'sequence'
                    WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view' WHEN 'c' THEN 'type'
                    WHEN 'p' THEN 'partitioned table' WHEN 'I' THEN 'partitioned index'
                    ELSE c.relkind::text END
               || CASE c.relpersistence WHEN 'u' THEN ' unlogged' ELSE '' END
               || coalesce(' (' || array_to_string(c.reloptions, ', ') || ')', '')
               || CASE WHEN c.relrowsecurity THEN ' row security' ELSE '' END
               || coalesce(' acl ' || c.relacl::text, '')
               || coalesce(' view ' || pg_get_viewdef(c.oid), '')
        FROM pg_class AS c WHERE c.relnamespace = $1""",
    "column": """
        SELECT c.relname || ' #'
               || lpad((row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum))::text, 2, '0')
               || ' ' || a.attname,
               format_type(a.atttypid, a.atttypmod)
               || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
               || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), '')
               || CASE a.attidentity WHEN 'a' THEN ' identity always'
                                     WHEN 'd' THEN ' identity by default' ELSE '' END
               || CASE a.attgenerated WHEN 's' THEN ' generated stored' ELSE '' END
               || CASE WHEN a.attcollation <> t.typcollation
                       THEN ' collate ' || a.attcollation::regcollation ELSE '' END
               || CASE WHEN a.attstorage <> t.typstorage
                       THEN ' storage ' || a.attstorage::text ELSE '' END
               || coalesce(' owns ' || pg_get_serial_sequence(c.oid::regclass::text, a.attname),
                           '')
               {compression}
        FROM pg_attribute AS a
        JOIN pg_class AS c ON c.oid = a.attrelid
        JOIN pg_type AS t ON t.oid = a.atttypid
        LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = $1 AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')
          AND a.attnum > 0 AND NOT a.attisdropped""",
    "constraint": """
        SELECT coalesce(c.relname, t.typname) || '.' || con.conname, pg_get_constraintdef(con.oid)
        FROM pg_constraint AS con
        LEFT JOIN pg_class AS c ON c.oid = con.conrelid
        LEFT JOIN pg_type AS t ON t.oid = con.contypid
        WHERE con.connamespace = $1""",
    "index": """
        SELECT c.relname, pg_get_indexdef(i.indexrelid)
               || CASE WHEN i.indisclustered THEN ' (clustered)' ELSE '' END
               || CASE WHEN i.indisreplident THEN ' (replica identity)' ELSE '' END
        FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
        WHERE c.relnamespace = $1""",
    "function": """
        SELECT p.proname || '(' || oidvectortypes(p.proargtypes) || ')',
               CASE WHEN p.prokind IN ('f', 'p') THEN pg_get_functiondef(p.oid)
                    ELSE 'kind ' || p.prokind::text END
               || coalesce(' acl ' || p.proacl::text, '')
        FROM pg_proc AS p WHERE p.pronamespace = $1""",
    "trigger": """
        SELECT c.relname || '.' || t.tgname,
               pg_get_triggerdef(t.oid) || CASE t.tgenabled WHEN 'O' THEN ''
                                                ELSE ' (enabled ' || t.tgenabled::text || ')' END
        FROM pg_trigger AS t JOIN pg_class AS c ON c.oid = t.tgrelid
        WHERE c.relnamespace = $1 AND NOT t.tgisinternal""",
    "sequence": """
        SELECT c.relname,
               format('%s start %s increment %s min %s max %s cache %s%s', s.seqtypid::regtype,
                      s.seqstart, s.seqincrement, s.seqmin, s.seqmax, s.seqcache,
                      CASE WHEN s.seqcycle THEN ' cycle' ELSE '' END)
        FROM pg_sequence AS s JOIN pg_class AS c ON c.oid = s.seqrelid
        WHERE c.relnamespace = $1""",
    "type": """
        SELECT t.typname,
               t.typtype::text || coalesce(' ' || format_type(nullif(t.typbasetype, 0), t.typtypmod), '')
               || CASE WHEN t.typnotnull THEN ' not null' ELSE '' END
               || coalesce(' default ' || t.typdefault, '')
               || coalesce(' (' || (SELECT string_agg(e.enumlabel, ', ' ORDER BY e.enumsortorder)
                                    FROM pg_enum AS e WHERE e.enumtypid = t.oid) || ')', '')
        FROM pg_type AS t LEFT JOIN pg_class AS c ON c.oid = t.typrelid
        WHERE t.typnamespace = $1 AND (c.oid IS NULL OR c.relkind = 'c')
          AND NOT (t.typtype = 'b' AND t.typcategory = 'A')""",
    "comment": """
        SELECT pg_describe_object(d.classoid, d.objoid, d.objsubid), d.description
        FROM pg_description AS d
        WHERE (d.classoid = 'pg_namespace'::regclass AND d.objoid = $1)
           OR (pg_identify_object(d.classoid, d.objoid, d.objsubid)).schema
              = (SELECT nspname FROM pg_namespace WHERE oid = $1)""",
}


async def catalog(conn: asyncpg.Connection, schema: str = "aioq") -> list[str]:
    """The schema as lines of text, sorted, its name written plainly (``"aioq".jobs`` as
    ``aioq.jobs``, as function bodies written either way read the same); a function's definition
    over several lines, each prefixed with its name."""
    oid = await conn.fetchval("SELECT oid FROM pg_namespace WHERE nspname = $1", schema)
    assert oid is not None, f"no schema {schema}"
    compression = ""
    if await conn.fetchval("SELECT current_setting('server_version_num')::int") >= 140000:
        compression = (
            "|| CASE WHEN a.attcompression::text <> ''"
            " THEN ' compression ' || a.attcompression::text ELSE '' END"
        )
    lines: list[str] = []
    for kind, query in CATALOG.items():
        rows = await conn.fetch(query.format(compression=compression), oid)
        for name, what in sorted((r[0], r[1]) for r in rows):
            head, *more = what.replace(f'"{schema}".', f"{schema}.").splitlines() or [""]
            lines.append(f"{kind} {name}: {head}")
            lines.extend(f"{kind} {name}| {line}" for line in more)
    for table in await conn.fetch(
        "SELECT relname FROM pg_class WHERE relnamespace = $1 AND relkind IN ('r', 'p')"
        " ORDER BY relname",
        oid,
    ):
        qualified = f'"{schema}"."{table[0]}"'
        if table[0] == "migrations":  # the versions recorded, not when
            versions = await conn.fetchval(
                f"SELECT array_agg(version ORDER BY version) FROM {qualified}"
            )
            lines.append(f"rows migrations: versions {versions}")
        else:
            lines.append(
                f"rows {table[0]}: {await conn.fetchval(f'SELECT count(*) FROM {qualified}')}"
            )
    return lines


def differences(migrated: list[str], written: list[str]) -> str:
    """A unified diff of two catalogs, empty when they are the same."""
    return "\n".join(
        difflib.unified_diff(
            migrated,
            written,
            "the migrations (aioq/sql/migrations)",
            "schema.sql",
            lineterm="",
            n=1,
        )
    )


@asynccontextmanager
async def fresh_database(admin_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a brand-new database of its own, without aioq's schema."""
    name = f"aioq_schema_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        conn = await asyncpg.connect(with_database(admin_dsn, name))
        try:
            yield conn
        finally:
            await conn.close()
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.mark.anyio
async def test_schema_sql_is_exactly_what_the_migrations_build(admin_dsn: str) -> None:
    async with fresh_database(admin_dsn) as migrated, fresh_database(admin_dsn) as written:
        # Through the migrations: each applied once, in order, recorded.
        assert await aioq.install(migrated) == list(range(1, LATEST + 1))
        assert await aioq.install(migrated) == []
        await written.execute(SCHEMA_SQL.read_text())
        diff = differences(await catalog(migrated), await catalog(written))
        if diff:
            pytest.fail(
                "schema.sql and the migrations build different schemas (- what the migrations"
                " build, + what schema.sql builds): make schema.sql say what the migrations do."
                f"\n{diff}",
                pytrace=False,
            )
        # Installed from schema.sql, the schema is recorded at the latest version.
        assert await aioq.install(written) == []
        assert (await migrate.status(written)).pending == []


@pytest.mark.anyio
async def test_schema_sql_without_its_versions_is_recognised_as_the_latest(admin_dsn: str) -> None:
    """Applied by hand without the rows that record it, schema.sql is what `aioq schema apply`
    recognises as the latest version: it records the versions and applies nothing."""
    text = SCHEMA_SQL.read_text()
    records = text.index("INSERT INTO aioq.migrations")
    async with fresh_database(admin_dsn) as conn:
        await conn.execute(text[:records])
        assert (await migrate.status(conn)).installed == 0
        assert await aioq.install(conn) == []
        assert (await migrate.status(conn)).installed == LATEST


@pytest.mark.anyio
async def test_the_comparison_sees_each_kind_of_difference(admin_dsn: str) -> None:
    """The catalog sees a change of each kind of object, and the diff names it."""
    async with fresh_database(admin_dsn) as conn:
        await aioq.install(conn)
        before = await catalog(conn)
        await conn.execute(
            """
            ALTER TABLE aioq.jobs ALTER COLUMN priority SET DEFAULT 1;
            ALTER TABLE aioq.queues ADD COLUMN compared text;
            ALTER TABLE aioq.jobs RESET (fillfactor);
            ALTER TABLE aioq.workflow_steps
                DROP CONSTRAINT workflow_steps_on_failure_check,
                ADD CONSTRAINT workflow_steps_on_failure_check
                    CHECK (on_failure IN ('cancel', 'run', 'skip'));
            DROP INDEX aioq.jobs_dead_idx;
            CREATE INDEX jobs_dead_idx ON aioq.jobs (queue, task) WHERE status = 'dead';
            CREATE OR REPLACE FUNCTION aioq.workflow_step_replayed() RETURNS trigger
            LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END; $$;
            ALTER TABLE aioq.jobs DISABLE TRIGGER jobs_workflow_step_changed;
            ALTER SEQUENCE aioq.jobs_id_seq CACHE 10;
            COMMENT ON TABLE aioq.schedules IS 'ticks';
            DELETE FROM aioq.migrations WHERE version = 3;
            """
        )
        diff = differences(before, await catalog(conn))
    for changed in (
        "+column jobs #06 priority: integer not null default 1",
        "+column queues #08 compared: text",
        "-relation jobs: table (fillfactor=80,",
        "+constraint workflow_steps.workflow_steps_on_failure_check: CHECK ((on_failure = ANY "
        "(ARRAY['cancel'::text, 'run'::text, 'skip'::text])))",
        "+index jobs_dead_idx: CREATE INDEX jobs_dead_idx ON aioq.jobs USING btree (queue, task)",
        "-function workflow_step_replayed()|     IF EXISTS (SELECT FROM aioq.workflow_steps AS w",
        "+trigger jobs.jobs_workflow_step_changed: CREATE TRIGGER",
        "+sequence jobs_id_seq: bigint start 1 increment 1 min 1 max 9223372036854775807 cache 10",
        "+comment table aioq.schedules: ticks",
        "+rows migrations: versions [1, 2, 4,",
    ):
        assert changed in diff, f"{changed!r} not in\n{diff}"


# --- one migration's data -------------------------------------------------------------------


@pytest.mark.anyio
async def test_migration_17_keeps_the_steps_a_failed_dependency_cancelled(admin_dsn: str) -> None:
    """Migration 17 moves what the workflow trigger's cascade records (the dependency that
    cancelled a step) from the step row to the job row, where the trigger's WHEN reads it: steps
    a dependency's death cancelled before the upgrade come back when it is replayed after."""
    registry = aioq.Registry()

    @registry.task
    async def step(n: int) -> None:
        pass

    async with fresh_database(admin_dsn) as conn:
        async with conn.transaction():
            await conn.execute(migrate.schema_sql(to_version=16))
        run = await aioq.chain(*(step.call(n=i) for i in range(3))).defer(conn)
        root, second, third = run.jobs.values()
        await conn.execute("UPDATE aioq.jobs SET status = 'dead' WHERE id = $1", root)
        assert await aioq.install(conn) == list(range(17, migrate.latest_version() + 1))
        rows = await conn.fetch("SELECT id, status, blocked_by FROM aioq.jobs ORDER BY id")
        assert [tuple(r) for r in rows] == [
            (root, "dead", None),
            (second, "cancelled", root),
            (third, "cancelled", second),
        ]
        replay = await aioq.admin.replay(conn, job_id=root)
        assert replay.revived == {second: "step-2", third: "step-3"}
        rows = await conn.fetch("SELECT id, status, blocked_by FROM aioq.jobs ORDER BY id")
        assert [tuple(r) for r in rows] == [
            (root, "pending", None),
            (second, "waiting", None),
            (third, "waiting", None),
        ]
