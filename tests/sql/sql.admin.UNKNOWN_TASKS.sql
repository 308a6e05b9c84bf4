-- aioq.sql.admin.UNKNOWN_TASKS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT queue, task, count(*) AS jobs, min(unknown_since) AS since
FROM "aioq".jobs
WHERE unknown_since IS NOT NULL AND status = 'pending'
GROUP BY queue, task
ORDER BY queue, task
