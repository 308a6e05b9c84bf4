"""The shop's HTTP API (FastAPI): POST /signup writes the user and defers the welcome."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import asyncpg
import shop
from fastapi import Depends, FastAPI
from pydantic import BaseModel

app = FastAPI()


async def connection() -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(shop.settings["dsn"])
    try:
        yield conn
    finally:
        await conn.close()


class Signup(BaseModel):
    email: str


@app.post("/signup", status_code=201)
async def post_signup(
    body: Signup, conn: Annotated[asyncpg.Connection, Depends(connection)]
) -> dict[str, int]:
    return {"job_id": await shop.signup(conn, body.email)}
