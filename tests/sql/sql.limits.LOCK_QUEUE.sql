-- aioq.sql.limits.LOCK_QUEUE, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queue
SELECT (max_running IS NOT NULL OR rate_limit IS NOT NULL OR paused
     OR max_running_per_key IS NOT NULL) AS limited FROM "aioq".queues WHERE name = $1 FOR NO KEY UPDATE
