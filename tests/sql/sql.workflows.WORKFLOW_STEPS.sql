-- aioq.sql.workflows.WORKFLOW_STEPS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :workflow
SELECT s.job_id, s.name, s.task, j.queue,
       coalesce(j.status, CASE WHEN s.succeeded_at IS NOT NULL THEN 'succeeded' ELSE 'deleted' END)
           AS status,
       ARRAY(SELECT p.name FROM "aioq".workflow_deps AS d
             JOIN "aioq".workflow_steps AS p ON p.job_id = d.parent_id
             WHERE d.job_id = s.job_id ORDER BY p.job_id) AS after,
       s.on_failure, j.attempts, j.last_error, s.result::text AS result
FROM "aioq".workflow_steps AS s
LEFT JOIN "aioq".jobs AS j ON j.id = s.job_id
WHERE s.workflow_id = $1
ORDER BY s.job_id
