"""Every statement is declared once, written as SQL (templates by the rules of aioq.sql),
prepares against the real schema, and its row type's fields are exactly its columns; every
statement as sent is checked in under tests/sql/ (docs/architecture.md, "Statements")."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import asyncpg
import pytest
from golden import COMMAND, all_statements, checked_in, problems

import aioq
import aioq.sql
from aioq.sql import Named, Statement, TemplateError, columns, fragments, integer, nothing

pytestmark = pytest.mark.anyio

PACKAGE = Path(aioq.__file__).parent


def test_the_statements_are_found() -> None:
    names = set(all_statements())
    assert {"sql.jobs.CLAIM_ONE_QUEUE", "sql.outcomes.WRITE_OUTCOMES", "web.sql.DASH_PAGE"} <= names
    assert len(names) >= 40


async def test_every_statement_prepares_and_its_row_type_matches_its_columns(
    conn: asyncpg.Connection,
) -> None:
    checked = 0
    for name, statement in all_statements().items():
        text = statement.text("aioq")
        if text.lstrip().startswith("VACUUM"):  # a utility statement: nothing to prepare
            continue
        prepared = await conn.prepare(text)
        inner = statement.statement if isinstance(statement, Named) else statement
        assert len(prepared.get_parameters()) == len(inner.params), name
        build = inner.build
        if isinstance(build, columns):
            names = [a.name for a in prepared.get_attributes()]
            fields = [f.name for f in dataclasses.fields(build.cls)]
            assert names == fields, name
            checked += 1
    assert checked >= 10


def test_a_statement_is_rendered_once_per_schema_and_validates_it() -> None:
    statement = all_statements()["sql.jobs.INSERT_JOB"]
    assert statement.text("aioq") is statement.text("aioq")
    assert '"other".jobs' in statement.text("other")
    assert "'aioq:other'" in statement.text("other")  # its doorbell channel
    with pytest.raises(aioq.errors.ConfigError):
        statement.text('x"; DROP TABLE jobs; --')


def test_the_sync_form_names_every_parameter_and_doubles_percent_signs() -> None:
    statement = Statement("SELECT :a, :b, :a, format('%s', :b)", nothing, ("b", "a"))
    assert statement.text("aioq") == "SELECT $2, $1, $2, format('%s', $1)"
    assert statement.text("aioq", sync=True) == "SELECT %(a)s, %(b)s, %(a)s, format('%%s', %(b)s)"


def test_parameters_are_bound_outside_literals_comments_and_casts() -> None:
    statement = Statement(
        """
SELECT :a::text, 'x :b y', "col:b", (:b)::int,  -- not :c
       arr[1 : 2] /* :c */
""",
        nothing,
        ("a", "b"),
    )
    text = statement.text("aioq")
    assert "$1::text, 'x :b y', \"col:b\", ($2)::int,  -- not :c" in text
    assert "arr[1 : 2] /* :c */" in text


def test_fragments_are_included_by_name_and_the_schema_is_quoted() -> None:
    statement = Statement(
        "SELECT id FROM @schema.jobs WHERE queue = :q AND @ready", integer, ("q",)
    )
    assert statement.text("s1") == (
        "SELECT id FROM \"s1\".jobs WHERE queue = $1 AND status = 'pending' AND run_at <= now()"
    )


@pytest.mark.parametrize(
    ("template", "params", "message"),
    [
        ("SELECT $1", (), "no \\$n"),
        ("SELECT {s}.x", (), "no \\$n, no Python format"),
        ("SELECT 1 FROM {{s}}.jobs", (), "no Python format"),
        ("SELECT @no_such_fragment", (), "no fragment NO_SUCH_FRAGMENT"),
        ("SELECT :a, :b", ("a",), ":b is not among"),
        ("SELECT :a", ("a", "b"), "\\['b'\\] are not in the template"),
        ("SELECT 1 -- see @fence", (), "a marker in a comment"),
        ("SELECT :a, :b, :c, :d, :e", ("a", "b", "c", "d", "e"), "passed by name"),
    ],
)
def test_a_template_that_breaks_the_rules_is_refused(
    template: str, params: tuple[str, ...], message: str
) -> None:
    with pytest.raises(TemplateError, match=message):
        Statement(template, nothing, params)


def test_a_named_statement_takes_a_dataclass_of_more_than_four() -> None:
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Few:
        a: int

    with pytest.raises(TemplateError, match="go positionally"):
        Named(Few, "SELECT :a", nothing)


def test_statements_and_fragments_are_written_as_literal_sql() -> None:
    # No f-string, concatenation or .format builds a template: each is one string literal,
    # as a reader reads it (fragments are included by name, never spliced in by Python).
    offenders = []
    modules = [p for p in sorted((PACKAGE / "sql").glob("*.py")) if p.name != "__init__.py"]
    for path in [*modules, PACKAGE / "web" / "sql.py"]:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "Statement",
                "Named",
            ):
                template = node.args[0 if node.func.id == "Statement" else 1]  # type: ignore[attr-defined]
                if not (isinstance(template, ast.Constant) and isinstance(template.value, str)):
                    offenders.append(f"{path.name}:{node.lineno}")
        if path.name == "fragments.py":
            for node in tree.body:
                name = ast.unparse(node.targets[0]) if isinstance(node, ast.Assign) else ""
                if name.isupper() and not isinstance(node.value, ast.Constant):  # type: ignore[attr-defined]
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_every_fragment_is_included_somewhere() -> None:
    templates = [
        (s.statement if isinstance(s, Named) else s).template for s in all_statements().values()
    ]
    texts = templates + [v for k, v in vars(fragments).items() if k.isupper()]
    unused = [
        name
        for name, value in vars(fragments).items()
        if name.isupper() and isinstance(value, str) and name != "ROLLUP_STEP"  # read by Python too
        if not any(re.search(rf"@{name.lower()}\b", text) for text in texts)
    ]
    assert unused == []


def test_the_histogram_sums_have_one_term_per_bucket() -> None:
    from aioq.sql.history import HIST_WIDTH

    for sums in (fragments.WAIT_HIST_SUMS, fragments.RUN_HIST_SUMS):
        found = [int(n) for n in re.findall(r"_hist\[(\d+)\]", sums)]
        assert found == list(range(1, HIST_WIDTH + 1))


@pytest.mark.parametrize(
    ("index", "equal", "more"),
    [
        ("jobs_claim_idx", ["queue"], []),  # every claim, the drain, the dashboard's pending
        ("jobs_key_claim_idx", ["queue", "concurrency_key"], ["concurrency_key IS NOT NULL"]),
    ],
)
async def test_the_ready_fragment_and_the_claim_order_are_the_claim_index(
    conn: asyncpg.Connection, index: str, equal: list[str], more: list[str]
) -> None:
    """@ready beside `queue = ...` (and a key) and @claim_order are exactly the claim's index,
    as PostgreSQL reports it: its key columns are those equalities then the claim order (a claim
    reads the index in claim order and sorts nothing), its predicate is @ready's condition on a
    column that is no key, and the rest of @ready are ranges on key columns."""
    keys = await conn.fetchval(
        """
        SELECT array_agg(pg_get_indexdef(i.indexrelid, k.n, true) ORDER BY k.n)
        FROM pg_index AS i, generate_series(1, i.indnkeyatts) AS k(n)
        WHERE i.indexrelid = $1::regclass
        """,
        f"aioq.{index}",
    )
    descending = await conn.fetchval(
        """
        SELECT array_agg((i.indoption[k.n - 1] & 1) = 1 ORDER BY k.n)
        FROM pg_index AS i, generate_series(1, i.indnkeyatts) AS k(n)
        WHERE i.indexrelid = $1::regclass
        """,
        f"aioq.{index}",
    )
    index_keys = [f"{k} DESC" if d else k for k, d in zip(keys, descending, strict=True)]
    assert index_keys == [*equal, *(k.strip() for k in fragments.CLAIM_ORDER.split(","))]

    predicate = (
        "SELECT pg_get_expr(indpred, indrelid) FROM pg_index WHERE indexrelid = $1::regclass"
    )
    conjuncts = [c.strip() for c in fragments.READY.split(" AND ")]
    on_keys = [c for c in conjuncts if c.split()[0] in keys]
    rest = [c for c in conjuncts if c not in on_keys]
    assert rest
    assert all(c.split()[1] in ("<", "<=", ">", ">=", "=") for c in on_keys)
    probe = " AND ".join([*rest, *more])
    async with conn.transaction():  # PostgreSQL's own spelling of @ready's other conditions
        await conn.execute(f"CREATE INDEX ready_probe ON aioq.jobs (id) WHERE {probe}")
        wanted = await conn.fetchval(predicate, "aioq.ready_probe")
        await conn.execute("DROP INDEX aioq.ready_probe")
    assert await conn.fetchval(predicate, f"aioq.{index}") == wanted


def test_every_statement_matches_its_golden_file() -> None:
    found = problems(checked_in())
    assert found is None, found


def test_a_changed_statement_fails_with_its_diff_and_the_command() -> None:
    have = checked_in()
    have["sql.jobs.CLAIM_ONE_QUEUE.sql"] = have["sql.jobs.CLAIM_ONE_QUEUE.sql"].replace(
        "FOR UPDATE SKIP LOCKED", "FOR UPDATE"
    )
    del have["sql.admin.PING.sql"]
    have["sql.gone.OLD.sql"] = "SELECT 1\n"
    found = problems(have)
    assert found is not None
    assert f"run `{COMMAND}`" in found
    assert "-    FOR UPDATE\n+    FOR UPDATE SKIP LOCKED" in found
    assert "tests/sql/sql.admin.PING.sql is missing" in found
    assert "tests/sql/sql.gone.OLD.sql is no statement's any more" in found
