"""A job deferred in the transaction of the row it belongs to, then run (the README's example).

Run it with AIOQ_DSN set to a database aioq may install its schema into:
`aioq dev` prints one of a throwaway PostgreSQL.
"""

import asyncio
import os

import asyncpg

import aioq


@aioq.task(max_attempts=5)  # a failure is retried with backoff, 5 runs at most
async def send_receipt(purchase_id: int) -> None:
    job = aioq.current_job()  # job.id: a stable idempotency key
    print(f"receipt for purchase {purchase_id} sent by job {job.id} (attempt {job.attempt})")


async def purchase(conn: asyncpg.Connection) -> int:
    async with conn.transaction():  # the purchase and its job commit together, or neither does
        purchase_id: int = await conn.fetchval("INSERT INTO purchases DEFAULT VALUES RETURNING id")
        await send_receipt.defer(conn, purchase_id=purchase_id)
    return purchase_id


async def main() -> None:
    dsn = os.environ["AIOQ_DSN"]
    conn = await asyncpg.connect(dsn)
    await aioq.install(conn)  # aioq's schema: idempotent, versioned
    await conn.execute("CREATE TABLE IF NOT EXISTS purchases (id serial PRIMARY KEY)")
    await purchase(conn)
    await conn.close()
    await aioq.Worker(dsn=dsn).run_until_idle()  # or run for ever: await worker.run()


if __name__ == "__main__":
    asyncio.run(main())
