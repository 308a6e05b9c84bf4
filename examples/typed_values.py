"""Typed values in, typed values out: the task's annotations are the schema of its job.

An invoice task takes a dataclass (with a UUID, a date, Decimal amounts and an enum inside) and
returns one; the job stores plain, readable JSON, and the worker hands the task real instances.
A job written by raw SQL in the same JSON forms runs the same way; one whose date cannot be
read ends dead at once, its last_error naming the argument and the path inside it.

Uses the database in AIOQ_DSN if set, otherwise starts a throwaway PostgreSQL.
Run it with `python examples/typed_values.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import date
from decimal import Decimal

import asyncpg

import aioq
from aioq.dev.server import EmbeddedPostgres

registry = aioq.Registry()


class Currency(enum.StrEnum):
    EUR = "EUR"
    USD = "USD"


@dataclass(frozen=True)
class Line:
    sku: str
    price: Decimal  # stored as the string "9.95": exact, never through a float
    qty: int = 1


@dataclass(frozen=True)
class Invoice:
    order: uuid.UUID
    due: date
    currency: Currency
    lines: list[Line]


@dataclass(frozen=True)
class Sent:
    order: uuid.UUID
    total: Decimal


@registry.task(result_ttl=3600)
async def send_invoice(invoice: Invoice) -> Sent:
    """Receives an Invoice (not a dict): every field is of its annotated type."""
    assert isinstance(invoice.due, date)
    assert isinstance(invoice.lines[0].price, Decimal)
    total = sum((line.price * line.qty for line in invoice.lines), Decimal(0))
    print(f"invoice for {invoice.order}: {total} {invoice.currency}, due {invoice.due}")
    return Sent(invoice.order, total)


@contextlib.asynccontextmanager
async def database() -> AsyncIterator[str]:
    """Yield a DSN: AIOQ_DSN, or a throwaway server removed on exit."""
    if dsn := os.environ.get("AIOQ_DSN"):
        yield dsn
        return
    async with EmbeddedPostgres() as server:
        yield server.dsn


async def main() -> None:
    async with database() as dsn:
        conn = await asyncpg.connect(dsn)
        await aioq.install(conn, schema=registry.schema)
        invoice = Invoice(
            order=uuid.UUID("7d3c8e1a-5b2f-4c6d-9e8f-0a1b2c3d4e5f"),
            due=date(2026, 12, 31),
            currency=Currency.EUR,
            lines=[Line("book", Decimal("9.95"), 2), Line("pen", Decimal("1.10"))],
        )
        job_id = await send_invoice.defer(conn, invoice=invoice)
        stored = await conn.fetchval("SELECT args::text FROM aioq.jobs WHERE id = $1", job_id)
        print("stored:", json.dumps(json.loads(stored), sort_keys=True))

        # Another program writes the same JSON forms; and one writes a date that is no date.
        raw = {**json.loads(stored)["invoice"], "order": str(uuid.UUID(int=2))}
        insert = "INSERT INTO aioq.jobs (task, args) VALUES ($1, $2::jsonb) RETURNING id"
        await conn.fetchval(insert, send_invoice.name, json.dumps({"invoice": raw}))
        bad = await conn.fetchval(
            insert, send_invoice.name, json.dumps({"invoice": {**raw, "due": "end of year"}})
        )

        # A value that does not fit is refused at defer, naming the path; nothing is written.
        wrong = Invoice(invoice.order, invoice.due, Currency.USD, [Line("cup", 3)])  # type: ignore[arg-type]
        try:
            await send_invoice.defer(conn, invoice=wrong)
        except aioq.ArgumentError as exc:
            print("refused:", exc)

        await aioq.Worker(dsn=dsn, registry=registry, poll_interval=0.2).run_until_idle()
        sent = await send_invoice.result(conn, job_id)
        print(f"result: {type(sent).__name__}(total={sent.total!r})")
        last_error = await conn.fetchval(
            "SELECT status || ': ' || last_error FROM aioq.jobs WHERE id = $1", bad
        )
        print("bad job:", last_error)
        await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
