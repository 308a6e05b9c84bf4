-- aioq.sql.admin.RELEASE_SAVEPOINT, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
RELEASE SAVEPOINT aioq_savepoint
