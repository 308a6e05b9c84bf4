-- aioq.sql.maintenance.PRUNE_UNIQUES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :limit
WITH deleted AS (
    DELETE FROM "aioq".uniques
    WHERE key IN (
        SELECT key FROM "aioq".uniques
        WHERE expires_at <= now()
        ORDER BY expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
