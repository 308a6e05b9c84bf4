-- aioq.sql.maintenance.PRUNE_ENDED, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :age, $2 :limit, $3 :status
WITH deleted AS (
    DELETE FROM "aioq".jobs
    WHERE id IN (
        SELECT id FROM "aioq".jobs
        WHERE status = $3 AND run_at < now() - make_interval(secs => $1::float8)
        ORDER BY run_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*)::integer FROM deleted
