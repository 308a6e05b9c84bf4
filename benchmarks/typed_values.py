"""Typed arguments against plain JSON ones: ``defer_many`` then a drain, one worker in this
process; prints one line ``RESULT {json}``.

    python benchmarks/typed_values.py --dsn postgresql://postgres@127.0.0.1/bench --shape plain
    python benchmarks/typed_values.py ... --shape dataclass   # a 10-field dataclass argument
    python benchmarks/typed_values.py ... --shape pydantic    # the same fields, a pydantic model

Every shape stores the same JSON (an order of 10 fields: an int, a UUID, a datetime, a
Decimal, an enum, a str, a float, a bool, a list of str, a date); ``plain`` passes that JSON
as a dict to a task annotated ``dict[str, Any]``, so the ratios show what converting costs:
encoding at ``defer_many``, decoding into instances before each run. ``make bench`` runs it as
the ``typed`` scenario (workloads.py); ``ab_drain.py --script typed_values.py`` alternates two
checkouts on one shape.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import statistics
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import aioq
import asyncpg


class Status(enum.Enum):
    NEW = "new"
    PAID = "paid"


@dataclass(frozen=True, slots=True)
class Order:
    id: int
    customer: uuid.UUID
    placed: datetime
    total: Decimal
    status: Status
    note: str
    weight: float
    gift: bool
    skus: list[str]
    ship_by: date


SHAPES = ("plain", "dataclass", "pydantic")


def orders(shape: str, start: int, count: int) -> list[dict[str, Any]]:
    """``count`` calls of the shape's task: the same data, as JSON or as instances."""
    customer = uuid.UUID("6f1c2d3e-4b5a-4c6d-8e7f-901a2b3c4d5e")
    placed = datetime(2026, 5, 1, 12, 30, tzinfo=UTC)
    out = []
    for i in range(start, start + count):
        order = Order(
            i, customer, placed, Decimal("129.90"), Status.PAID, "leave at the door", 2.5,
            False, ["A-1", "B-22"], date(2026, 5, 8),
        )  # fmt: skip
        if shape == "plain":
            out.append({"order": {
                "id": i, "customer": str(customer), "placed": placed.isoformat(),
                "total": "129.90", "status": "paid", "note": order.note, "weight": 2.5,
                "gift": False, "skus": ["A-1", "B-22"], "ship_by": "2026-05-08",
            }})  # fmt: skip
        elif shape == "dataclass":
            out.append({"order": order})
        else:
            out.append({"order": OrderModel(**{f: getattr(order, f) for f in FIELDS})})
    return out


FIELDS = Order.__dataclass_fields__.keys()
OrderModel: Any = None


def registry_for(shape: str) -> tuple[aioq.Registry, aioq.Task[..., Any]]:
    """A registry with the shape's task, named "order"."""
    global OrderModel
    registry = aioq.Registry()
    if shape == "plain":

        @registry.task(name="order")
        async def plain(order: dict[str, Any]) -> None:
            assert type(order) is dict

        return registry, plain
    if shape == "dataclass":

        @registry.task(name="order")
        async def typed(order: Order) -> None:
            assert type(order) is Order

        return registry, typed
    import pydantic

    class Model(pydantic.BaseModel):
        id: int
        customer: uuid.UUID
        placed: datetime
        total: Decimal
        status: Status
        note: str
        weight: float
        gift: bool
        skus: list[str]
        ship_by: date

    OrderModel = Model  # a global: the task's annotation names it

    @registry.task(name="order")
    async def modelled(order: OrderModel) -> None:
        assert type(order) is Model

    return registry, modelled


async def measure(
    dsn: str, shape: str, n: int, batch: int, concurrency: int, defer_rounds: int = 1
) -> dict[str, Any]:
    """defer_many ``n`` jobs (in batches), then drain them; rates and CPU per 1 000 jobs.

    ``defer_rounds`` > 1: defer the ``n`` jobs that many times (deleting them in between) and
    report the median round, then drain the last."""
    registry, task = registry_for(shape)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS aioq CASCADE")
        await aioq.install(conn)
        calls = [orders(shape, start, batch) for start in range(0, n, batch)]
        await task.defer_many(conn, orders(shape, -batch, batch))  # warm up
        await conn.execute("DELETE FROM aioq.jobs")
        await conn.execute("VACUUM ANALYZE aioq.jobs")
        rounds: list[tuple[float, float]] = []
        for round_ in range(defer_rounds):
            if round_:
                await conn.execute("TRUNCATE aioq.jobs")
            cpu0, t0 = time.process_time(), time.perf_counter()
            for chunk in calls:
                await task.defer_many(conn, chunk)
            rounds.append((time.perf_counter() - t0, time.process_time() - cpu0))
        defer_s = statistics.median(r[0] for r in rounds)
        defer_cpu = statistics.median(r[1] for r in rounds)
        await conn.execute("VACUUM ANALYZE aioq.jobs")
        worker = aioq.Worker(
            dsn=dsn,
            registry=registry,
            concurrency=concurrency,
            stats_history=False,
            vacuum_threshold=None,
        )
        cpu0, t0 = time.process_time(), time.perf_counter()
        await worker.run_until_idle()
        drain_s, drain_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        left = await conn.fetchval("SELECT count(*) FROM aioq.jobs")
        assert left == 0, f"{left} jobs left (a run failed?)"
    finally:
        await conn.close()
    return {
        "shape": shape,
        "defer_per_s": n / defer_s,
        "drain_per_s": n / drain_s,
        "defer_cpu_ms_per_1000": 1e6 * defer_cpu / n,
        "drain_cpu_ms_per_1000": 1e6 * drain_cpu / n,
        "jobs_per_s": n / drain_s,  # what ab_drain.py compares
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--shape", choices=SHAPES, default="plain")
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--defer-rounds", type=int, default=1)
    args = parser.parse_args()
    result = await measure(
        args.dsn, args.shape, args.n, args.batch, args.concurrency, args.defer_rounds
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
