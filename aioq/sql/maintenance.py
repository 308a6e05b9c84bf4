"""Upkeep: retention of archived, dead and cancelled jobs and of results; the jobs table's
vacuum. docs/architecture.md, "Cleanup".

Every prune deletes at most a batch, picked with SKIP LOCKED, so no statement runs long or holds
many locks and every worker can prune at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioq.sql import Statement, columns, integer, nothing

__all__ = (
    "JOBS_DEAD_TUPLES",
    "PRUNE_ARCHIVE",
    "PRUNE_ENDED",
    "PRUNE_RESULTS",
    "PRUNE_UNIQUES",
    "VACUUM_JOBS",
    "VACUUM_TIMEOUT",
    "DeadTuples",
)

VACUUM_TIMEOUT = 3600.0
"""Seconds a VACUUM of the jobs table may take before it is cancelled."""


def _delete_oldest(table: str, key: str, where: str, order: str, limit: str) -> str:
    """A bounded prune: delete at most ``limit`` rows of ``table`` that match ``where``, the
    oldest by ``order`` first, skipping rows another transaction holds; count them."""
    return f"""
WITH deleted AS (
    DELETE FROM {{s}}.{table}
    WHERE {key} IN (
        SELECT {key} FROM {{s}}.{table}
        WHERE {where}
        ORDER BY {order}
        LIMIT {limit}
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
"""


# Archived rows finished more than $1 seconds ago, at most $2.
PRUNE_ARCHIVE = Statement(
    _delete_oldest(
        "archive",
        "id",
        "finished_at < now() - make_interval(secs => $1::float8)",
        "finished_at",
        "$2",
    ),
    integer,
)

# Kept terminal jobs of status $3 ('dead' or 'cancelled') have no finished_at: their age is
# counted from run_at, which every statement that ends a job sets to when it ended.
PRUNE_ENDED = Statement(
    _delete_oldest(
        "jobs",
        "id",
        "status = $3 AND run_at < now() - make_interval(secs => $1::float8)",
        "run_at",
        "$2",
    ),
    integer,
)

# Results past their TTL, at most $1.
PRUNE_RESULTS = Statement(
    _delete_oldest("results", "id", "expires_at < now()", "expires_at", "$1"), integer
)


# Unique windows that have ended, at most $1 (docs/architecture.md, "Unique jobs"). A defer
# taking an expired row over holds its lock: SKIP LOCKED leaves it to that defer.
PRUNE_UNIQUES = Statement(
    _delete_oldest("uniques", "key", "expires_at <= now()", "expires_at", "$1"), integer
)


@dataclass(frozen=True, slots=True)
class DeadTuples:
    """The jobs table's dead tuples, and whether this role may vacuum it (owner or member)."""

    dead: int
    owner: bool


JOBS_DEAD_TUPLES = Statement(
    """
SELECT coalesce(s.n_dead_tup, 0) AS dead, pg_has_role(c.relowner, 'USAGE') AS owner
FROM pg_class AS c
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE c.oid = '{s}.jobs'::regclass
""",
    columns(DeadTuples),
)

# SKIP_LOCKED: when another worker (or autovacuum) is vacuuming the table, skip it at once.
VACUUM_JOBS = Statement("VACUUM (SKIP_LOCKED) {s}.jobs", nothing)
