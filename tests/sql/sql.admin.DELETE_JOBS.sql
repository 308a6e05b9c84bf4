-- aioq.sql.admin.DELETE_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :ids
WITH locked AS (
    SELECT j.id FROM "aioq".jobs AS j
    WHERE j.id = ANY($1::bigint[]) AND j.status IN ('pending', 'dead', 'cancelled')
      AND NOT (j.status = 'pending' AND j.workflow_id IS NOT NULL)
    ORDER BY j.id
    FOR UPDATE OF j
)
DELETE FROM "aioq".jobs AS j
USING locked
WHERE j.id = locked.id
RETURNING j.id
