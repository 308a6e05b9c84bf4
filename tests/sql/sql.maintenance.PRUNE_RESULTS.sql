-- aioq.sql.maintenance.PRUNE_RESULTS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :limit
WITH deleted AS (
    DELETE FROM "aioq".results
    WHERE id IN (
        SELECT id FROM "aioq".results
        WHERE expires_at < now()
        ORDER BY expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
