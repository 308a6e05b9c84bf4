"""Every SQL statement aioq runs, each declared once as a :class:`Statement` with its row type.

The statements are grouped by what they serve, one module each:

=================  ==========================================================================
``jobs``           defer (the inserts) and the claim
``outcomes``       every write fenced on a claim: outcomes, heartbeat, release, progress
``control``        cancel requests, awaited results
``admin``          inspection, replay, deletion, queue and table statistics, test helpers
``maintenance``    retention (pruning) and the vacuum of the jobs table
``schedules``      periodic ticks
``limits``         fleet-wide queue limits and pauses
``history``        the per-minute outcome history and the workers' rows
``doorbell``       the worker's side of the conditional NOTIFY
``schema``         migrations
=================  ==========================================================================

The dashboard's reads are its own (``aioq/web/sql.py``). A template names the schema ``{s}``
(replaced by the quoted, validated name) and the schema's doorbell channel ``{channel}`` (a
string literal); values are always bind parameters. A statement is rendered once per schema
and called directly, ``await CLAIM.rows(db, schema, ...)``: no method per statement sits
between the caller and the SQL.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Generic, TypeVar

from aioq.db import Executor, Row, SyncExecutor
from aioq.errors import ConfigError

__all__ = (
    "DEFAULT_SCHEMA",
    "LIMITS_CHANGED",
    "Row",
    "Statement",
    "boolean",
    "channel_name",
    "columns",
    "control_channel",
    "integer",
    "nothing",
    "quote_schema",
    "render",
    "results_channel",
    "text",
)

T = TypeVar("T")

DEFAULT_SCHEMA = "aioq"
"""The schema aioq uses unless told otherwise."""

SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,57}$")


def quote_schema(schema: str) -> str:
    """Validate a schema name and return it quoted as an identifier."""
    if not isinstance(schema, str) or not SCHEMA_NAME.fullmatch(schema):
        raise ConfigError(
            "schema",
            f"{schema!r} is not a valid schema name (letters, digits and _, at most 58 characters,"
            " not starting with a digit)",
        )
    return f'"{schema}"'


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


def render(template: str, schema: str) -> str:
    """Fill a statement template with the quoted schema name and its channel literal."""
    # Both are safe to splice: quote_schema() admits letters, digits and _ only.
    return template.replace("{s}", quote_schema(schema)).replace(
        "{channel}", f"'{channel_name(schema)}'"
    )


_PARAMETER = re.compile(r"\$(\d+)")


def pyformat(text: str) -> str:
    """Return a rendered statement with DB-API ``pyformat`` parameters (``%(p1)s`` for ``$1``).

    For synchronous drivers (psycopg, through Django or SQLAlchemy): the same statement text,
    its values passed as ``{"p1": ...}``. A literal ``%`` is doubled.
    """
    return _PARAMETER.sub(r"%(p\1)s", text.replace("%", "%%"))


class Statement(Generic[T]):
    """One statement: its template, what each of its rows becomes, its text per schema."""

    __slots__ = ("_texts", "build", "template")

    def __init__(self, template: str, build: Callable[[Row], T]) -> None:
        self.template = template
        self.build = build
        self._texts: dict[tuple[str, bool], str] = {}

    def __repr__(self) -> str:
        first = " ".join(self.template.split())[:60]
        return f"<Statement {first}...>"

    def text(self, schema: str, *, sync: bool = False) -> str:
        """The statement for a schema: ``$n`` parameters, or ``pyformat`` ones with ``sync``."""
        try:
            return self._texts[schema, sync]
        except KeyError:
            text = render(self.template, schema)
            self._texts[schema, sync] = text = pyformat(text) if sync else text
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
        return [build(r) for r in db(self.text(schema, sync=True), _by_name(args))]

    def row_sync(self, db: SyncExecutor, schema: str, *args: object) -> T | None:
        """Run the statement on a synchronous connection; return its first row, or None."""
        found = db(self.text(schema, sync=True), _by_name(args))
        return self.build(found[0]) if found else None


def _by_name(args: tuple[object, ...]) -> dict[str, object]:
    """The values of ``$1``, ``$2``, ... as the ``pyformat`` text names them."""
    return {f"p{i}": value for i, value in enumerate(args, 1)}


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
