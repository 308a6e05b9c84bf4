-- aioq.sql.workflows.GET_WORKFLOW, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :workflow
SELECT w.id, w.name, w.created_at, w.steps,
       count(*) FILTER (WHERE j.status = 'waiting')::integer AS waiting,
       count(*) FILTER (WHERE j.status = 'pending')::integer AS pending,
       count(*) FILTER (WHERE j.status = 'running')::integer AS running,
       count(*) FILTER (WHERE j.id IS NULL AND s.succeeded_at IS NOT NULL)::integer AS succeeded,
       count(*) FILTER (WHERE j.status = 'dead')::integer AS dead,
       count(*) FILTER (WHERE j.status = 'cancelled')::integer AS cancelled
FROM "aioq".workflows AS w
LEFT JOIN "aioq".workflow_steps AS s ON s.workflow_id = w.id
LEFT JOIN "aioq".jobs AS j ON j.id = s.job_id
WHERE w.id = $1
GROUP BY w.id
