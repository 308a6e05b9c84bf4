"""The reference: a bare asyncpg INSERT of the same row, no library and no trigger.

The table is ``bare.jobs``: aioq's jobs table's columns, defaults, constraints, indexes and
storage settings (``LIKE ... INCLUDING ALL``), without the doorbell trigger.
"""

from __future__ import annotations

import asyncpg

from systems import System
from systems.sys_aioq import Adapter as AioqAdapter

INSERT = (
    "INSERT INTO bare.jobs (queue, task, args) VALUES ('default', 'noop', $1::text::jsonb)"
    " RETURNING id"
)
INSERT_MANY = (
    "INSERT INTO bare.jobs (queue, task, args)"
    " SELECT 'default', 'noop', a::jsonb FROM unnest($1::text[]) AS a"
    " RETURNING id"
)


TABLE = """
CREATE SCHEMA bare;
CREATE TABLE bare.jobs (LIKE aioq.jobs INCLUDING ALL);
ALTER TABLE bare.jobs SET (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500, autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0);
"""


class Adapter(System):
    name = "bare"
    single_api = "asyncpg fetchval(INSERT ... VALUES ... RETURNING id) into a trigger-less copy"
    bulk_api = "asyncpg fetch(INSERT ... SELECT FROM unnest($1) RETURNING id)"

    async def install(self, dsn: str) -> None:
        await AioqAdapter().install(dsn)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(TABLE)
        finally:
            await conn.close()

    async def open(self, dsn: str) -> None:
        self.conn = await asyncpg.connect(dsn)

    async def close(self) -> None:
        await self.conn.close()

    async def defer_one(self, i: int) -> None:
        await self.conn.fetchval(INSERT, f'{{"i": {i}}}')

    async def defer_many(self, start: int, count: int) -> None:
        await self.conn.fetch(INSERT_MANY, [f'{{"i": {i}}}' for i in range(start, start + count)])

    async def remaining(self) -> int:
        return await self.conn.fetchval("SELECT count(*) FROM bare.jobs")  # type: ignore[no-any-return]
