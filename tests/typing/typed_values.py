"""Typed arguments and results: lines marked ``# error`` must be mypy errors.

``test_values.py::test_mypy_checks_typed_arguments_and_types_results`` runs ``mypy --strict``
on this file and checks that exactly the marked lines are reported (the others type-check).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import date
from decimal import Decimal

import asyncpg

import aioq

registry = aioq.Registry()


@dataclass(frozen=True)
class Invoice:
    """A dataclass argument and result."""

    id: uuid.UUID
    total: Decimal


@registry.task(result_ttl=3600)
async def send_invoice(invoice: Invoice, due: date) -> Invoice:
    """Typed values in, a typed value out."""
    return invoice


async def main(conn: asyncpg.Connection) -> None:
    """Defer with typed values; read the result as the task's return type."""
    invoice = Invoice(uuid.uuid4(), Decimal("9.90"))
    jid = await send_invoice.defer(conn, invoice=invoice, due=date(2026, 12, 31))
    back: Invoice = await send_invoice.result(conn, jid)
    total: Decimal = back.total
    await send_invoice.defer(conn, invoice=invoice, due="2026-12-31")  # error: [arg-type]
    await send_invoice.defer(conn, invoice={"id": "x"}, due=date.today())  # error: [arg-type]
    send_invoice.call(invoice=invoice, due=date.today())
    send_invoice.call(invoice=invoice.id, due=date.today())  # error: [arg-type]
    wrong: str = await send_invoice.result(conn, jid)  # error: [assignment]
    print(total, wrong)
