"""Run aioq's statements on Django's database connection: ``task.defer_sync(connection, ...)``.

``django.db.connection`` (or ``connections[alias]``) on PostgreSQL, either of Django's
drivers (psycopg 3 or psycopg2). A job is inserted with a cursor of that connection, so it
joins the ``transaction.atomic()`` block in progress on that alias: rolled back, no job.
Outside one, Django's autocommit commits it at once, as it would the view's own writes.
"""

from __future__ import annotations

from typing import Any

from aioq.dbapi import SyncExecutor, run_cursor
from aioq.errors import ConfigError

__all__ = ("executor",)


def executor(target: Any) -> SyncExecutor:
    """Return the runner of statements on a Django connection (or connection proxy)."""
    vendor = getattr(target, "vendor", None)
    if vendor is None:
        raise ConfigError(
            "conn", f"expected django.db.connection or connections[alias], got {target!r}"
        )
    if vendor != "postgresql":
        raise ConfigError(
            "conn",
            f"Django database {target.alias!r} is {vendor}; aioq's jobs live in PostgreSQL"
            " (ENGINE django.db.backends.postgresql)",
        )

    def run(sql: str, params: Any) -> Any:
        with target.cursor() as cursor:
            return run_cursor(cursor, sql, params)

    return run
