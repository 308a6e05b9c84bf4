"""Place an order: the order's row and its receipt job commit in one transaction.

`python place_order.py ada@example.org`, with AIOQ_DSN set (docs/getting-started.md).
"""

from __future__ import annotations

import asyncio
import os
import sys

import asyncpg
from tasks import send_receipt


async def place_order(email: str) -> None:
    conn = await asyncpg.connect(os.environ["AIOQ_DSN"])
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS shop_orders (id serial PRIMARY KEY, email text NOT NULL)"
        )
        async with conn.transaction():  # both commit, or neither does
            order_id = await conn.fetchval(
                "INSERT INTO shop_orders (email) VALUES ($1) RETURNING id", email
            )
            job_id = await send_receipt.defer(conn, order_id=order_id, email=email)
        print(f"order {order_id} placed; its receipt is job {job_id}")
    finally:
        await conn.close()


if __name__ == "__main__":
    asyncio.run(place_order(sys.argv[1]))
