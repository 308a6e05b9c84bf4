"""The HTTP endpoint, called in-process through httpx2 (installed by aioq-pg[testing])."""

from __future__ import annotations

import asyncpg
import httpx2
import pytest
from api import app
from shop import send_welcome

import aioq.testing

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("shop_database")]


async def test_post_signup_defers_the_welcome(aioq_conn: asyncpg.Connection) -> None:
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://shop") as client:
        response = await client.post("/signup", json={"email": "ada@example.org"})
    assert response.status_code == 201
    [job] = await aioq.testing.deferred(aioq_conn, send_welcome)
    assert job.id == response.json()["job_id"]
