"""A worker's hold on its id: one live worker per worker id (docs/architecture.md, "Worker ids").

A worker given its id holds a session advisory lock on it, on a direct connection of its own,
for as long as it runs: the key is the id hashed to 64 bits, seeded with the schema's jobs
table, so the same id in two schemas are two keys, and a one-bigint key never meets the
doorbell's two-integer keys (PostgreSQL keeps the two kinds apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from aioq.sql import Statement, boolean, columns

__all__ = ("HOLDS_WORKER_ID", "TAKE_WORKER_ID", "WORKER_ID_HOLDER", "Holder")

# True if this session now holds the worker id (it is free, or this session held it already).
TAKE_WORKER_ID = Statement(
    """
SELECT pg_try_advisory_lock(hashtextextended(:worker::text, '@schema.jobs'::regclass::oid::bigint))
""",
    boolean,
    ("worker",),
)

# Whether this session holds the worker id: the hold's check, every few seconds (taking the lock
# again would stack one more hold each time).
HOLDS_WORKER_ID = Statement(
    """
SELECT EXISTS (
    SELECT FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted AND l.objsubid = 1
      AND ((l.classid::bigint << 32) | l.objid::bigint)
          = hashtextextended(:worker::text, '@schema.jobs'::regclass::oid::bigint)
)
""",
    boolean,
    ("worker",),
)


@dataclass(frozen=True, slots=True)
class Holder:
    """The session that holds a worker id, as far as this role may see it (NULL otherwise)."""

    pid: int  # its server process
    address: str | None  # its client's address (None: a Unix socket, or not visible)
    application_name: str | None
    since: datetime | None  # when its connection began


# Who holds a worker id, for the refusal's message. A bigint advisory key shows in pg_locks as
# its high half (classid) and low half (objid), objsubid 1.
WORKER_ID_HOLDER = Statement(
    """
SELECT l.pid, host(a.client_addr) AS address, a.application_name, a.backend_start AS since
FROM pg_locks AS l
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint)
      = hashtextextended(:worker::text, '@schema.jobs'::regclass::oid::bigint)
LIMIT 1
""",
    columns(Holder),
    ("worker",),
)
