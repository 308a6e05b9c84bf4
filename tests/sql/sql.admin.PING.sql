-- aioq.sql.admin.PING, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT 1
