-- aioq.sql.history.RECENT_OUTCOMES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT queue, sum(completed)::bigint AS completed, sum(retried + dead)::bigint AS failed
FROM "aioq".stats_history
WHERE minute >= date_trunc('minute', now()) - interval '1 minute'
GROUP BY queue
