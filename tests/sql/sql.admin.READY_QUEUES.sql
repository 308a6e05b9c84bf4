-- aioq.sql.admin.READY_QUEUES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT DISTINCT queue FROM "aioq".jobs WHERE status = 'pending' AND run_at <= now() ORDER BY queue
