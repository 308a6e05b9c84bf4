-- aioq.sql.limits.QUEUE_SETTINGS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT q.name, q.max_running, q.rate_limit,
       extract(epoch FROM q.rate_period)::float8 AS rate_period, q.paused, q.updated_at,
       CASE WHEN q.rate_limit IS NOT NULL THEN (
           SELECT coalesce(sum(c.claims), 0)::integer FROM "aioq".queue_claims AS c
           WHERE c.queue = q.name AND c.slot_end > clock_timestamp() - q.rate_period) END
           AS window_claims,
       q.max_running_per_key
FROM "aioq".queues AS q
ORDER BY q.name
