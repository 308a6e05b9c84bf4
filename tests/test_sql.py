"""Every statement is declared once, prepares against the real schema, and its row type's fields
are exactly its columns (docs/architecture.md, "Statements")."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

import asyncpg
import pytest

import aioq
import aioq.sql
from aioq.sql import Statement, columns, pyformat

pytestmark = pytest.mark.anyio


def all_statements() -> dict[str, Statement[Any]]:
    """Every statement of aioq/sql/ and of the dashboard (aioq/web/sql.py), by name."""
    modules = [f"aioq.sql.{info.name}" for info in pkgutil.iter_modules(aioq.sql.__path__)]
    found: dict[str, Statement[Any]] = {}
    for module_name in [*modules, "aioq.web.sql"]:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if isinstance(value, Statement):
                found[f"{module_name.removeprefix('aioq.')}.{name}"] = value
    return found


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
        build = statement.build
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
    with pytest.raises(aioq.errors.ConfigError):
        statement.text('x"; DROP TABLE jobs; --')


def test_pyformat_names_every_parameter_and_doubles_percent_signs() -> None:
    text = "SELECT $1, $10, $1, format('%s', $2)"
    assert pyformat(text) == "SELECT %(p1)s, %(p10)s, %(p1)s, format('%%s', %(p2)s)"
