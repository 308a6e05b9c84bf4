-- aioq.sql.history.FORGET_WORKER, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :worker
DELETE FROM "aioq".workers WHERE id = $1
