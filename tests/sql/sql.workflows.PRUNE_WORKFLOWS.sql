-- aioq.sql.workflows.PRUNE_WORKFLOWS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :age, $2 :limit
WITH old AS (
    SELECT w.id FROM "aioq".workflows AS w
    WHERE w.created_at < now() - make_interval(secs => $1::float8)
      AND NOT EXISTS (SELECT FROM "aioq".jobs AS j WHERE j.workflow_id = w.id)
    ORDER BY w.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
steps AS (
    DELETE FROM "aioq".workflow_steps AS s USING old WHERE s.workflow_id = old.id
    RETURNING s.job_id
),
edges AS (
    DELETE FROM "aioq".workflow_deps AS d USING steps WHERE d.job_id = steps.job_id
),
gone AS (
    DELETE FROM "aioq".workflows AS w USING old WHERE w.id = old.id
    RETURNING w.id
)
SELECT count(*) FROM gone
