-- aioq.sql.admin.PENDING_TASKS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT DISTINCT task, queue FROM "aioq".jobs WHERE status = 'pending' ORDER BY task, queue
