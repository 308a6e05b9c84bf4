-- aioq.sql.admin.DELETE_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :ids
DELETE FROM "aioq".jobs
WHERE id = ANY($1::bigint[]) AND status IN ('pending', 'dead', 'cancelled')
  AND NOT (status = 'pending' AND workflow_id IS NOT NULL)
RETURNING id
