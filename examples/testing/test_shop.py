"""Testing a signup that defers a job, with the aioq pytest plugin (docs/testing.md)."""

from __future__ import annotations

import asyncpg
import pytest
from shop import audit, send_welcome, signup

import aioq
import aioq.testing

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("shop_database")]


async def test_signup_defers_a_welcome(aioq_conn: asyncpg.Connection) -> None:
    job_id = await signup(aioq_conn, "ada@example.org")
    [job] = await aioq.testing.deferred(aioq_conn, send_welcome)
    assert (job.id, job.queue) == (job_id, "email")
    assert job.args == {"email": "ada@example.org"}
    assert job.unique_key == "welcome:ada@example.org"


async def test_the_welcome_runs_and_audits(
    aioq_conn: asyncpg.Connection, aioq_drain: aioq.testing.Drain
) -> None:
    await signup(aioq_conn, "ada@example.org")
    ran = await aioq_drain()  # the welcome, then the audit job it deferred
    assert [(r.task, r.outcome) for r in ran] == [
        (send_welcome.name, "succeeded"),
        (audit.name, "succeeded"),
    ]
    assert ran[1].args == {"event": "welcomed ada@example.org"}
    assert await aioq.testing.deferred(aioq_conn, send_welcome) == []


async def test_a_bounce_is_retried(
    aioq_conn: asyncpg.Connection, aioq_drain: aioq.testing.Drain
) -> None:
    await signup(aioq_conn, "bob@bounce.example")
    [ran] = await aioq_drain()
    assert ran.outcome == "retried"
    assert ran.error is not None
    assert "mailbox bob@bounce.example unavailable" in ran.error
    [job] = await aioq.testing.deferred(aioq_conn, send_welcome)  # waiting for its backoff
    assert job.attempts == 1
