-- aioq.sql.limits.LIMITED_QUEUES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queues
SELECT name, extract(epoch FROM rate_period)::float8 AS rate_period
FROM "aioq".queues WHERE name = ANY($1::text[]) AND (max_running IS NOT NULL OR rate_limit IS NOT NULL OR paused
     OR max_running_per_key IS NOT NULL)
