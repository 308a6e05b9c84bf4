-- aioq.sql.workflows.UPSTREAM, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :id
SELECT p.name, p.job_id, p.task,
       coalesce(j.status, CASE WHEN p.succeeded_at IS NOT NULL THEN 'succeeded' ELSE 'deleted' END)
           AS status,
       p.result::text AS result, j.last_error
FROM "aioq".workflow_deps AS d
JOIN "aioq".workflow_steps AS p ON p.job_id = d.parent_id
LEFT JOIN "aioq".jobs AS j ON j.id = p.job_id
WHERE d.job_id = $1
ORDER BY p.job_id
