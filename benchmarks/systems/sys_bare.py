"""The reference: a bare asyncpg INSERT of the same row into aioq's jobs table (no library)."""

from __future__ import annotations

import asyncpg

from systems import System
from systems.sys_aioq import Adapter as AioqAdapter

INSERT = (
    "INSERT INTO aioq.jobs (queue, task, args) VALUES ('default', 'noop', $1::text::jsonb)"
    " RETURNING id"
)
INSERT_MANY = (
    "INSERT INTO aioq.jobs (queue, task, args)"
    " SELECT 'default', 'noop', a::jsonb FROM unnest($1::text[]) AS a"
    " RETURNING id"
)


class Adapter(System):
    name = "bare"
    single_api = "asyncpg fetchval(INSERT ... VALUES ... RETURNING id)"
    bulk_api = "asyncpg fetch(INSERT ... SELECT FROM unnest($1) RETURNING id)"

    async def install(self, dsn: str) -> None:
        await AioqAdapter().install(dsn)

    async def open(self, dsn: str) -> None:
        self.conn = await asyncpg.connect(dsn)

    async def close(self) -> None:
        await self.conn.close()

    async def defer_one(self, i: int) -> None:
        await self.conn.fetchval(INSERT, f'{{"i": {i}}}')

    async def defer_many(self, start: int, count: int) -> None:
        await self.conn.fetch(INSERT_MANY, [f'{{"i": {i}}}' for i in range(start, start + count)])

    async def remaining(self) -> int:
        return await self.conn.fetchval("SELECT count(*) FROM aioq.jobs")  # type: ignore[no-any-return]
