-- aioq.sql.maintenance.PRUNE_ARCHIVE, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :age, $2 :limit
WITH deleted AS (
    DELETE FROM "aioq".archive
    WHERE id IN (
        SELECT id FROM "aioq".archive
        WHERE finished_at < now() - make_interval(secs => $1::float8)
        ORDER BY finished_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
