"""A FastAPI app that runs an aioq worker inside its lifespan.

POST /users writes a user and defers its welcome job in ONE transaction: both commit or
neither does. The worker in the same process sends the welcome. The aioq dashboard (read-only)
is mounted at /aioq/ (needs aioq-pg[web]). Run it with

    AIOQ_DSN=postgresql://... uvicorn --factory examples.fastapi_app:app_from_env
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel

import aioq
import aioq.web

registry = aioq.Registry()

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, name text NOT NULL);
CREATE TABLE IF NOT EXISTS welcomes (user_id bigint PRIMARY KEY, job_id bigint NOT NULL);
"""


@registry.task(queue="email")
async def send_welcome(user_id: int) -> None:
    """Record the welcome once per user, whatever the number of deliveries (idempotent)."""
    job = aioq.current_job()
    async with _pool().acquire() as conn:
        await conn.execute(
            "INSERT INTO welcomes (user_id, job_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            user_id,
            job.id,
        )


_pools: list[asyncpg.Pool] = []


def _pool() -> asyncpg.Pool:
    return _pools[-1]


class NewUser(BaseModel):
    name: str


class Created(BaseModel):
    user_id: int
    job_id: int


class JobState(BaseModel):
    job_id: int
    state: str  # pending, running, dead, succeeded (kept in the archive), or done (deleted)
    last_error: str | None = None


def create_app(dsn: str, *, concurrency: int = 10) -> FastAPI:
    """Build the app; its lifespan owns the pool, the worker and the dashboard's pool."""
    dashboard = aioq.web.app(dsn=dsn, schema=registry.schema)  # add actions=True, authorize=...

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A mounted app's lifespan is not run by Starlette: enter the dashboard's (it closes
        # the dashboard's small pool at shutdown).
        async with (
            dashboard.router.lifespan_context(dashboard),
            asyncpg.create_pool(dsn, min_size=1, max_size=10) as pool,
        ):
            async with pool.acquire() as conn:
                await aioq.install(conn, schema=registry.schema)
                await conn.execute(SCHEMA)
            _pools.append(pool)
            app.state.pool = pool
            # One connection budget: the worker borrows the app's pool (and never closes it);
            # dsn is for its one LISTEN connection. No queues given: it serves "default" and
            # every queue the registry's tasks name, here "email".
            worker = aioq.Worker(pool=pool, dsn=dsn, registry=registry, concurrency=concurrency)
            try:
                async with worker:  # stops gracefully when the app shuts down
                    yield
            finally:
                _pools.remove(pool)

    app = FastAPI(lifespan=lifespan)
    app.mount("/aioq", dashboard)

    @app.post("/users", status_code=201)
    async def create_user(user: NewUser, request: Request) -> Created:
        pool: asyncpg.Pool = request.app.state.pool
        async with pool.acquire() as conn, conn.transaction():
            user_id = await conn.fetchval(
                "INSERT INTO users (name) VALUES ($1) RETURNING id", user.name
            )
            job_id = await send_welcome.defer(conn, user_id=user_id)
        return Created(user_id=user_id, job_id=job_id)

    @app.get("/jobs/{job_id}")
    async def job_state(job_id: int, request: Request) -> JobState:
        pool: asyncpg.Pool = request.app.state.pool
        job = await aioq.admin.get_job(pool, job_id, schema=registry.schema)
        if job is not None:
            return JobState(job_id=job_id, state=job.status.value, last_error=job.last_error)
        welcomed = await pool.fetchval("SELECT 1 FROM welcomes WHERE job_id = $1", job_id)
        if welcomed is None:
            raise HTTPException(404, f"no job {job_id}")
        return JobState(job_id=job_id, state="done")

    return app


def app_from_env() -> FastAPI:
    """Build the app from AIOQ_DSN (for ``uvicorn --factory``)."""
    return create_app(os.environ["AIOQ_DSN"])
