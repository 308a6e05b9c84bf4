"""Periodic jobs on a registry of your own (docs/tasks.md): `aioq worker periodic:registry`.

The cron schedule needs the cron extra (pip install 'aioq-pg[cron]'); every= needs nothing.
"""

from __future__ import annotations

from datetime import timedelta

import aioq

registry = aioq.Registry()


@aioq.periodic(cron="0 3 * * *", tz="Europe/Paris")  # every night at 03:00, Paris time
@registry.task(queue="maintenance")
async def purge_expired_carts() -> None:
    tick = aioq.current_job().scheduled_at  # the tick this job is for
    print(f"carts expired before {tick:%Y-%m-%d %H:%M} UTC purged")


@aioq.periodic(every=timedelta(minutes=5), kwargs={"currency": "EUR"})
@registry.task
async def refresh_rates(currency: str) -> None:
    print(f"{currency} rates refreshed")
