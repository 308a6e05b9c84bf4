-- aioq.sql.history.PRUNE_STATS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :age, $2 :limit
WITH gone AS (
    DELETE FROM "aioq".workers WHERE last_seen < now() - make_interval(secs => $1::float8)
),
rolled AS (
    DELETE FROM "aioq".stats_rollup
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM "aioq".stats_rollup
        WHERE minute < now() - make_interval(secs => $1::float8 + 1800)
        LIMIT $2
    ))
)
DELETE FROM "aioq".stats_history
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM "aioq".stats_history
    WHERE minute < now() - make_interval(secs => $1::float8)
    LIMIT $2
))
