-- aioq.sql.workflows.NEW_JOB_IDS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :steps
SELECT ARRAY(SELECT nextval(pg_get_serial_sequence('"aioq".jobs', 'id'))
             FROM generate_series(1, $1))
