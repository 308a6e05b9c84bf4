"""Upkeep: retention of archived, dead and cancelled jobs and of results; the jobs table's
vacuum. docs/architecture.md, "Cleanup".

Every prune deletes at most a batch, picked with SKIP LOCKED, so no statement runs long or holds
many locks and every worker can prune at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioq.sql import Statement, columns, integer, nothing

__all__ = (
    "ANALYZE_JOBS",
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


# Each prune deletes the oldest rows that match, at most :limit, skipping rows another
# transaction holds (SKIP LOCKED), and counts them.

# Archived rows finished more than :age seconds ago.
PRUNE_ARCHIVE = Statement(
    """
WITH deleted AS (
    DELETE FROM @schema.archive
    WHERE id IN (
        SELECT id FROM @schema.archive
        WHERE finished_at < now() - make_interval(secs => :age::float8)
        ORDER BY finished_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
""",
    integer,
    ("age", "limit"),
)

# Kept jobs of status :status ('dead' or 'cancelled') ended more than :age seconds ago (pruned).
# They have no finished_at: their age is counted from run_at, which every statement that ends a
# job sets to when it ended.
PRUNE_ENDED = Statement(
    """
WITH deleted AS (
    DELETE FROM @schema.jobs
    WHERE id IN (
        SELECT id FROM @schema.jobs
        WHERE status = :status AND run_at < now() - make_interval(secs => :age::float8)
        ORDER BY run_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
""",
    integer,
    ("age", "limit", "status"),
)

# Results past their TTL.
PRUNE_RESULTS = Statement(
    """
WITH deleted AS (
    DELETE FROM @schema.results
    WHERE id IN (
        SELECT id FROM @schema.results
        WHERE expires_at < now()
        ORDER BY expires_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
""",
    integer,
    ("limit",),
)

# Unique windows that have ended (docs/architecture.md, "Unique jobs"). A defer taking an
# expired row over holds its lock: SKIP LOCKED leaves it to that defer.
PRUNE_UNIQUES = Statement(
    """
WITH deleted AS (
    DELETE FROM @schema.uniques
    WHERE key IN (
        SELECT key FROM @schema.uniques
        WHERE expires_at <= now()
        ORDER BY expires_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
""",
    integer,
    ("limit",),
)


@dataclass(frozen=True, slots=True)
class DeadTuples:
    """The jobs table's dead tuples, and whether this role may vacuum it (owner or member);
    what the planner believes of its size (``reltuples``, -1 before any VACUUM or ANALYZE;
    ``relpages``) against what it holds now (``live`` rows, ``pages``)."""

    dead: int
    owner: bool
    reltuples: float = 0.0
    relpages: int = 0
    live: int = 0
    pages: int = 0


JOBS_DEAD_TUPLES = Statement(
    """
SELECT coalesce(s.n_dead_tup, 0) AS dead, pg_has_role(c.relowner, 'USAGE') AS owner,
       c.reltuples::float8 AS reltuples, c.relpages AS relpages,
       coalesce(s.n_live_tup, 0) AS live,
       (pg_relation_size(c.oid) / current_setting('block_size')::integer)::integer AS pages
FROM pg_class AS c
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE c.oid = '@schema.jobs'::regclass
""",
    columns(DeadTuples),
)

# SKIP_LOCKED: when another worker (or autovacuum) is vacuuming the table, skip it at once.
VACUUM_JOBS = Statement("VACUUM (SKIP_LOCKED) @schema.jobs", nothing)

# The planner's statistics of the jobs table, renewed (docs/architecture.md, "Cleanup").
ANALYZE_JOBS = Statement("ANALYZE (SKIP_LOCKED) @schema.jobs", nothing)
