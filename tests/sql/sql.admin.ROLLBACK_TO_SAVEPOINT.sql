-- aioq.sql.admin.ROLLBACK_TO_SAVEPOINT, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
ROLLBACK TO SAVEPOINT aioq_savepoint
