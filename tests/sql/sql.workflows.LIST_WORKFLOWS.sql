-- aioq.sql.workflows.LIST_WORKFLOWS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :limit, $2 :name, $3 :bound
WITH newest AS (
    SELECT id FROM "aioq".workflows
    WHERE ($2::text IS NULL OR name = $2)
    ORDER BY id DESC LIMIT $1
)
SELECT w.id, w.name, w.created_at, w.steps, c.waiting, c.pending, c.running, w.succeeded,
       c.dead, c.cancelled
FROM newest
JOIN "aioq".workflows AS w USING (id)
CROSS JOIN LATERAL "aioq".workflow_counts(w.id, $3::integer) AS c
ORDER BY w.id DESC
