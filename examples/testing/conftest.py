"""Point the aioq plugin at the app's registry, and the app at the plugin's database."""

from __future__ import annotations

import asyncpg
import pytest
import shop

import aioq


@pytest.fixture
def aioq_registry() -> aioq.Registry:
    return shop.registry


@pytest.fixture
async def shop_database(aioq_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not autouse: plain `def` tests live in this folder too, and pytest refuses to give an
    # async fixture to a sync test. The tests that need the app's tables ask for them.
    monkeypatch.setitem(shop.settings, "dsn", aioq_dsn)
    conn = await asyncpg.connect(aioq_dsn)
    try:
        await conn.execute(shop.SCHEMA)  # only aioq's schema is new for each test
    finally:
        await conn.close()
