-- aioq.sql.workflows.CREATE_WORKFLOW, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :name, $2 :steps
WITH w AS (
    INSERT INTO "aioq".workflows (name, steps) VALUES ($1, $2) RETURNING id
)
SELECT w.id, ARRAY(SELECT nextval(pg_get_serial_sequence('"aioq".jobs', 'id'))
                   FROM generate_series(1, $2)) AS ids
FROM w
