"""aioq in one file: defer jobs in your transaction, run a worker, watch them complete.

Uses the database in AIOQ_DSN if set, otherwise starts a throwaway PostgreSQL.
Run it with `make demo` or `python examples/quickstart.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator

import anyio
import asyncpg

import aioq
from aioq.dev.server import EmbeddedPostgres

registry = aioq.Registry()
receipts: list[int] = []


@registry.task(max_attempts=3, retry=aioq.Backoff(base=0.2, max=1.0))
async def send_receipt(order_id: int, email: str) -> None:
    """Pretend to e-mail a receipt; the first attempt for order 2 fails and is retried."""
    job = aioq.current_job()
    if order_id == 2 and job.attempt == 1:
        raise ConnectionError("mail server busy")
    receipts.append(order_id)
    print(f"  job {job.id}: receipt for order {order_id} sent to {email} (attempt {job.attempt})")


@registry.task
def resize_avatar(user_id: int) -> None:
    """A plain function runs in a worker thread."""
    print(f"  job {aioq.current_job().id}: avatar of user {user_id} resized in a thread")


@contextlib.asynccontextmanager
async def database() -> AsyncIterator[str]:
    """Yield a DSN: AIOQ_DSN, or a throwaway server removed on exit."""
    if dsn := os.environ.get("AIOQ_DSN"):
        print(f"using AIOQ_DSN={dsn}")
        yield dsn
        return
    print("AIOQ_DSN is not set: starting a throwaway PostgreSQL ...")
    async with EmbeddedPostgres() as server:
        print(f"  running at {server.dsn}")
        yield server.dsn


async def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="  [%(name)s] %(message)s")
    logging.getLogger("aioq.worker.completer").setLevel(logging.INFO)  # one line per job outcome
    async with database() as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await aioq.install(conn, schema=registry.schema)
            await conn.execute("CREATE TABLE IF NOT EXISTS orders (id int PRIMARY KEY, email text)")
            await conn.execute("TRUNCATE orders")

            print("\n1. an order and its receipt job commit together:")
            async with conn.transaction():
                for order_id in (1, 2):
                    email = f"buyer{order_id}@example.com"
                    await conn.execute("INSERT INTO orders VALUES ($1, $2)", order_id, email)
                    job_id = await send_receipt.defer(conn, order_id=order_id, email=email)
                    print(f"  order {order_id} inserted, job {job_id} deferred")
            await resize_avatar.defer(conn, user_id=7)

            print("\n2. a rolled-back transaction defers nothing:")
            with contextlib.suppress(RuntimeError):
                async with conn.transaction():
                    await conn.execute("INSERT INTO orders VALUES (3, 'buyer3@example.com')")
                    await send_receipt.defer(conn, order_id=3, email="buyer3@example.com")
                    raise RuntimeError("payment declined")
            orders = await conn.fetchval("SELECT count(*) FROM orders WHERE id = 3")
            jobs = await conn.fetchval(
                "SELECT count(*) FROM aioq.jobs WHERE args->>'order_id' = '3'"
            )
            print(f"  payment declined: order 3 rows = {orders}, its jobs = {jobs}")

            print("\n3. a worker runs the jobs (order 2's first attempt fails and is retried):")
            async with aioq.Worker(dsn=dsn, registry=registry, concurrency=4, poll_interval=0.2):
                with anyio.fail_after(30):
                    while await conn.fetchval("SELECT count(*) FROM aioq.jobs"):
                        await anyio.sleep(0.1)

            left = await conn.fetchval("SELECT count(*) FROM aioq.jobs")
            print(
                f"\ndone: receipts sent for orders {sorted(receipts)}; jobs left in the queue: {left}"
            )
            if sorted(receipts) != [1, 2] or left != 0 or orders or jobs:
                raise SystemExit("the demo did not go as expected")
        finally:
            await conn.close()


if __name__ == "__main__":
    anyio.run(main)
