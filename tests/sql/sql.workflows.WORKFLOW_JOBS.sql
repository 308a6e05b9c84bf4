-- aioq.sql.workflows.WORKFLOW_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :workflow
SELECT id FROM "aioq".jobs
WHERE workflow_id = $1 AND status IN ('waiting', 'pending', 'running')
ORDER BY id
