-- aioq.sql.admin.BLOCKED_STEPS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :ids
WITH RECURSIVE up(id, failed, depth) AS (
    SELECT j.id, j.blocked_by, 1 FROM "aioq".jobs AS j
    WHERE j.id = ANY($1::bigint[]) AND j.status = 'cancelled' AND j.blocked_by IS NOT NULL
    UNION ALL
    SELECT u.id, j.blocked_by, u.depth + 1
    FROM up AS u
    JOIN "aioq".jobs AS j ON j.id = u.failed
    WHERE j.blocked_by IS NOT NULL
)
SELECT DISTINCT ON (u.id) u.id, u.failed, coalesce(j.status, 'deleted') AS status, s.name
FROM up AS u
LEFT JOIN "aioq".jobs AS j ON j.id = u.failed
LEFT JOIN "aioq".workflow_steps AS s ON s.job_id = u.failed
ORDER BY u.id, u.depth DESC
