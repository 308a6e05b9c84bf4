-- aioq.sql.maintenance.ANALYZE_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
ANALYZE (SKIP_LOCKED) "aioq".jobs
