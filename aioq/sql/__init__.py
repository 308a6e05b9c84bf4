"""Every SQL statement aioq runs, each declared once with its row type.

The statements are grouped by what they serve, one module each:

=================  ==========================================================================
``jobs``           defer (the inserts) and the claim
``outcomes``       every write fenced on a claim: outcomes, heartbeat, release, the rescue
``control``        cancel requests, awaited results
``admin``          inspection, replay, deletion, queue and table statistics, test helpers
``maintenance``    retention (pruning) and the vacuum of the jobs table
``schedules``      periodic ticks
``limits``         fleet-wide queue limits and pauses
``history``        the per-minute outcome history and the workers' rows
``identity``       a worker's hold on its id (one live worker per id)
``doorbell``       the worker's side of the conditional NOTIFY
``schema``         migrations
``fragments``      the pieces of SQL several statements share, included by name
=================  ==========================================================================

The dashboard's reads are its own (``aioq/web/sql.py``).

A template is SQL with three kinds of names in it, and nothing else to fill in
(docs/architecture.md, "Statements"):

- ``:name`` a bind parameter (``:queue``, ``:ids``), sent as ``$1``, ``$2``, ... in the order
  the statement declares its parameters (asyncpg), or as ``%(name)s`` (the synchronous drivers'
  ``pyformat``). Values are always bind parameters.
- ``@schema`` the schema, validated once and quoted (``"aioq"``); ``@doorbell`` the schema's
  doorbell channel as a string literal (``'aioq:aioq'``).
- ``@name`` any other: the fragment ``NAME`` of :mod:`aioq.sql.fragments`, included as written
  (a fragment includes others the same way), its lines after the first indented as the line
  that includes it.

A statement takes at most four parameters, positionally in its declared order; one with more
takes a frozen dataclass of them, by name (:class:`Named`), so that mypy names a missing one.
A statement is rendered once per schema and called directly, ``await CLAIM.rows(db, schema,
...)``: no method per statement sits between the caller and the SQL.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from aioq.db import Executor, Row, SyncExecutor
from aioq.errors import ConfigError, TemplateError
from aioq.sql import fragments

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = (
    "DEFAULT_SCHEMA",
    "LIMITS_CHANGED",
    "MAX_POSITIONAL",
    "Named",
    "Row",
    "Statement",
    "TemplateError",
    "boolean",
    "channel_name",
    "columns",
    "control_channel",
    "integer",
    "nothing",
    "quote_identifier",
    "quote_schema",
    "results_channel",
    "script",
    "text",
)

T = TypeVar("T")
P = TypeVar("P", bound="DataclassInstance")

DEFAULT_SCHEMA = "aioq"
"""The schema aioq uses unless told otherwise."""

SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,57}$")

MAX_POSITIONAL = 4
"""The most parameters a statement takes positionally; one with more takes a dataclass."""


def quote_schema(schema: str) -> str:
    """Validate a schema name and return it quoted as an identifier."""
    if not isinstance(schema, str) or not SCHEMA_NAME.fullmatch(schema):
        raise ConfigError(
            "schema",
            f"{schema!r} is not a valid schema name (letters, digits and _, at most 58 characters,"
            " not starting with a digit)",
        )
    return f'"{schema}"'


def quote_identifier(name: str) -> str:
    """Quote any name as an identifier (a throwaway database's, which is no bind parameter)."""
    return '"' + name.replace('"', '""') + '"'


def channel_name(schema: str) -> str:
    """Return the schema's doorbell channel: a queue has ready jobs, payload the queue name."""
    return f"aioq:{schema}"


def control_channel(schema: str) -> str:
    """Return the schema's control channel: cancel requests for running jobs, payload the job id.

    Five characters of prefix like the doorbell's, so any valid schema name fits PostgreSQL's
    63-byte channel names.
    """
    return f"aioq!{schema}"


def results_channel(schema: str) -> str:
    """Return the schema's results channel: a job someone may await has ended, payload its id."""
    return f"aioq={schema}"


LIMITS_CHANGED = ""
"""The doorbell payload that says queue limits changed (never a queue name: those are never
empty)."""


# --- templates ---

# What a template holds besides plain SQL: string literals and quoted identifiers (whose text is
# data: no parameter in them; @schema only), comments, parameters (`:name`, never the `::` of
# a cast) and markers (`@name`).
_LEXEME = re.compile(
    r"(?P<literal>'(?:[^']|'')*')"
    r'|(?P<identifier>"(?:[^"]|"")*")'
    r"|(?P<comment>--[^\n]*|/\*.*?\*/)"
    r"|(?<![:\w]):(?P<param>[A-Za-z_]\w*)"
    r"|@(?P<marker>[A-Za-z_]\w*)"
    r"|(?P<forbidden>\$\d|[{}])",
    re.S,
)
# Markers filled per schema (the others are fragments, included once).
_SCHEMA_MARKERS = ("schema", "doorbell")
_FRAGMENTS = {
    name.lower(): value
    for name, value in vars(fragments).items()
    if name.isupper() and isinstance(value, str)
}


def _expand(template: str, seen: tuple[str, ...] = ()) -> str:
    """The template with every fragment included (recursively); parameters left as written."""

    def include(match: re.Match[str]) -> str:
        if match["forbidden"]:
            raise TemplateError(
                f"{match[0]!r} in a template: parameters are :name, the schema @schema"
                " (no $n, no Python format holes)"
            )
        if match["comment"] and "@" in match[0]:
            raise TemplateError(f"a marker in a comment would be included there: {match[0]!r}")
        name = match["marker"]
        if name is None or name in _SCHEMA_MARKERS:
            return match[0]
        if name not in _FRAGMENTS:
            raise TemplateError(f"@{name}: no fragment {name.upper()} in aioq.sql.fragments")
        if name in seen:
            raise TemplateError(f"@{name} includes itself: {' -> '.join((*seen, name))}")
        text = _FRAGMENTS[name]
        if "--" in text.rstrip().rpartition("\n")[2]:
            raise TemplateError(f"@{name} ends in a comment, which would swallow what follows")
        # Its lines after the first start where the including line starts (as it is read).
        line = match.string[match.string.rfind("\n", 0, match.start()) + 1 : match.start()]
        indent = line[: len(line) - len(line.lstrip())]
        return _expand(text, (*seen, name)).replace("\n", "\n" + indent)

    return _LEXEME.sub(include, template)


def _bind(expanded: str, params: tuple[str, ...], *, sync: bool) -> str:
    """The expanded template with its parameters as ``$n`` (or, with ``sync``, ``%(name)s``
    and every other ``%`` doubled); the names must be exactly the declared ones."""
    number = {name: i for i, name in enumerate(params, 1)}
    used: set[str] = set()
    pieces: list[str] = []
    end = 0
    for match in _LEXEME.finditer(expanded):
        name = match["param"]
        if name is None:
            continue
        if name not in number:
            raise TemplateError(f":{name} is not among the declared parameters {params}")
        used.add(name)
        pieces.append(_plain(expanded[end : match.start()], sync))
        pieces.append(f"%({name})s" if sync else f"${number[name]}")
        end = match.end()
    pieces.append(_plain(expanded[end:], sync))
    if unused := [name for name in params if name not in used]:
        raise TemplateError(f"declared parameters {unused} are not in the template")
    return "".join(pieces)


def _plain(sql: str, sync: bool) -> str:
    return sql.replace("%", "%%") if sync else sql


_PER_SCHEMA = re.compile(r"@(schema|doorbell)\b")


def _render(expanded: str, schema: str) -> str:
    """Fill a statement's text with the quoted schema name and its doorbell channel literal."""
    # Both are safe to splice: quote_schema() admits letters, digits and _ only.
    values = {"schema": quote_schema(schema), "doorbell": f"'{channel_name(schema)}'"}
    return _PER_SCHEMA.sub(lambda m: values[m[1]], expanded)


def script(template: str, schema: str, **values: int | str) -> str:
    """A template rendered with its parameters written as literals, for a script that runs
    without bind parameters (``aioq schema sql``): integers, and text quoted as a literal."""
    expanded = _expand(template)

    def literal(match: re.Match[str]) -> str:
        name = match["param"]
        if name is None:
            return match[0]
        value = values[name]
        if isinstance(value, int):
            return str(int(value))
        return "'" + value.replace("'", "''") + "'"

    return _render(_LEXEME.sub(literal, expanded), schema)


class Statement(Generic[T]):
    """One statement: its template, its parameters in call order, what each of its rows
    becomes, and its text per schema."""

    __slots__ = ("_bound", "_texts", "build", "params", "template")

    def __init__(
        self,
        template: str,
        build: Callable[[Row], T],
        params: tuple[str, ...] = (),
        *,
        named: bool = False,
    ) -> None:
        if len(params) > MAX_POSITIONAL and not named:
            raise TemplateError(
                f"{len(params)} parameters {params}: more than {MAX_POSITIONAL} are passed by"
                " name (declare a dataclass of them and the statement as Named)"
            )
        if len(set(params)) != len(params):
            raise TemplateError(f"a parameter is declared twice: {params}")
        self.template = template
        self.build = build
        self.params = params
        expanded = _expand(template)
        # Both forms are checked here, as the module is imported: a bad template never runs.
        self._bound = (_bind(expanded, params, sync=False), _bind(expanded, params, sync=True))
        self._texts: dict[tuple[str, bool], str] = {}

    def __repr__(self) -> str:
        first = " ".join(self.template.split())[:60]
        return f"<Statement {first}...>"

    def text(self, schema: str, *, sync: bool = False) -> str:
        """The statement for a schema: ``$n`` parameters, or ``pyformat`` ones with ``sync``."""
        try:
            return self._texts[schema, sync]
        except KeyError:
            self._texts[schema, sync] = text = _render(self._bound[sync], schema)
            return text

    async def rows(
        self, db: Executor, schema: str, *args: object, within: float | None = None
    ) -> list[T]:
        """Run the statement; return its rows."""
        build = self.build
        return [build(r) for r in await db.fetch(self.text(schema), *args, timeout=within)]

    async def row(
        self, db: Executor, schema: str, *args: object, within: float | None = None
    ) -> T | None:
        """Run the statement; return its first row, or None when it returned none."""
        found = await db.fetchrow(self.text(schema), *args, timeout=within)
        return None if found is None else self.build(found)

    async def run(
        self, db: Executor, schema: str, *args: object, within: float | None = None
    ) -> None:
        """Run the statement for its effect."""
        await db.execute(self.text(schema), *args, timeout=within)

    def rows_sync(self, db: SyncExecutor, schema: str, *args: object) -> list[T]:
        """Run the statement on a synchronous connection (aioq.dbapi); return its rows."""
        build = self.build
        found = db(self.text(schema, sync=True), dict(zip(self.params, args, strict=True)))
        return [build(r) for r in found]

    def row_sync(self, db: SyncExecutor, schema: str, *args: object) -> T | None:
        """Run the statement on a synchronous connection; return its first row, or None."""
        found = db(self.text(schema, sync=True), dict(zip(self.params, args, strict=True)))
        return self.build(found[0]) if found else None


class Named(Generic[P, T]):
    """A statement of more than four parameters: they are the fields of a dataclass ``P``
    (frozen, keyword-only), in the order of its fields, so every call names each one."""

    __slots__ = ("params", "statement", "values")

    def __init__(self, params: type[P], template: str, build: Callable[[Row], T]) -> None:
        names = tuple(f.name for f in dataclasses.fields(params))
        if len(names) <= MAX_POSITIONAL:
            raise TemplateError(f"{params.__name__}: {len(names)} parameters go positionally")
        self.params = params
        self.statement = Statement(template, build, names, named=True)
        # The values in the statement's order ($1, $2, ...): one C call per statement run.
        self.values: Callable[[P], tuple[object, ...]] = operator.attrgetter(*names)

    def __repr__(self) -> str:
        return f"<Named {self.params.__name__} {self.statement!r}>"

    def text(self, schema: str, *, sync: bool = False) -> str:
        """The statement for a schema (see :meth:`Statement.text`)."""
        return self.statement.text(schema, sync=sync)

    def bind(self, params: P) -> tuple[Statement[T], tuple[object, ...]]:
        """The statement and its values in its order, to run later (``statement.row(db,
        schema, *values)``): for a caller that picks among statements of both kinds."""
        return self.statement, self.values(params)

    async def rows(
        self, db: Executor, schema: str, params: P, *, within: float | None = None
    ) -> list[T]:
        """Run the statement; return its rows."""
        return await self.statement.rows(db, schema, *self.values(params), within=within)

    async def row(
        self, db: Executor, schema: str, params: P, *, within: float | None = None
    ) -> T | None:
        """Run the statement; return its first row, or None when it returned none."""
        return await self.statement.row(db, schema, *self.values(params), within=within)

    async def run(
        self, db: Executor, schema: str, params: P, *, within: float | None = None
    ) -> None:
        """Run the statement for its effect."""
        await self.statement.run(db, schema, *self.values(params), within=within)

    def rows_sync(self, db: SyncExecutor, schema: str, params: P) -> list[T]:
        """Run the statement on a synchronous connection; return its rows."""
        return self.statement.rows_sync(db, schema, *self.values(params))

    def row_sync(self, db: SyncExecutor, schema: str, params: P) -> T | None:
        """Run the statement on a synchronous connection; return its first row, or None."""
        return self.statement.row_sync(db, schema, *self.values(params))


class columns(Generic[T]):
    """Build a row type (a dataclass) from a row by column name: its fields are the columns.

    tests/test_sql.py prepares every statement built this way and checks that its columns are
    exactly the fields, so the names never drift apart.
    """

    __slots__ = ("cls",)

    def __init__(self, cls: type[T]) -> None:
        self.cls = cls

    def __call__(self, row: Row) -> T:
        return self.cls(**dict(row.items()))


def integer(row: Row) -> int:
    """The row's first column, an integer (an id, a count)."""
    return int(row[0])


def text(row: Row) -> str:
    """The row's first column, text (a name)."""
    return str(row[0])


def boolean(row: Row) -> bool:
    """The row's first column, a boolean (NULL reads as false)."""
    return bool(row[0])


def nothing(row: Row) -> None:
    """For statements run for their effect only."""
    return None
