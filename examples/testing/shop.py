"""A tiny app to test: a signup writes a user and defers its welcome, which defers an audit."""

from __future__ import annotations

import os

import asyncpg

import aioq

registry = aioq.Registry()
settings = {"dsn": os.environ.get("SHOP_DSN", "")}  # the tests point it at aioq_dsn


@registry.task(queue="email", max_attempts=3)
async def send_welcome(email: str) -> None:
    """Send the welcome mail, then record it in the audit queue."""
    if email.endswith("@bounce.example"):
        raise ConnectionError(f"mailbox {email} unavailable")
    conn = await asyncpg.connect(settings["dsn"])
    try:
        await audit.defer(conn, event=f"welcomed {email}")
    finally:
        await conn.close()


@registry.task(queue="audit")
async def audit(event: str) -> None:
    """Keep an audit line."""


@registry.task(queue="images")
def make_thumbnail(path: str) -> str:
    """Write a thumbnail named after its job (a plain def runs in a worker thread)."""
    return f"{path.removesuffix('.png')}-thumb-{aioq.current_job().id}.png"


SCHEMA = "DROP TABLE IF EXISTS users; CREATE TABLE users (email text PRIMARY KEY)"


async def signup(conn: asyncpg.Connection, email: str) -> int:
    """Create a user and defer the welcome in the same transaction; return the job id."""
    async with conn.transaction():
        await conn.execute("INSERT INTO users VALUES ($1)", email)
        welcome = send_welcome.options(unique_key=f"welcome:{email}")  # one welcome per user
        return await welcome.defer(conn, email=email)
