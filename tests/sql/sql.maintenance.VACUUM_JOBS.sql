-- aioq.sql.maintenance.VACUUM_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
VACUUM (SKIP_LOCKED) "aioq".jobs
