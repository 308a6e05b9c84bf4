-- aioq.sql.admin.SAVEPOINT, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SAVEPOINT aioq_savepoint
