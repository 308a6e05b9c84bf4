"""Point the aioq plugin at the app's registry, and the app at the plugin's database."""

from __future__ import annotations

import asyncpg
import pytest
import shop

import aioq


@pytest.fixture
def aioq_registry() -> aioq.Registry:
    return shop.registry


@pytest.fixture(autouse=True)
async def shop_database(aioq_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # aioq_dsn's database lives for the session and only aioq's schema is new for each test:
    # the app's own tables are the app's to set up.
    monkeypatch.setitem(shop.settings, "dsn", aioq_dsn)
    conn = await asyncpg.connect(aioq_dsn)
    try:
        await conn.execute(shop.SCHEMA)
    finally:
        await conn.close()
