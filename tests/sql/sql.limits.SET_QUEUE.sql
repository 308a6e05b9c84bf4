-- aioq.sql.limits.SET_QUEUE, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queue, $2 :set_max_running, $3 :max_running, $4 :set_rate, $5 :rate_limit, $6 :rate_period, $7 :set_paused, $8 :paused, $9 :must_exist, $10 :doorbell, $11 :set_max_running_per_key, $12 :max_running_per_key (the fields of aioq.sql.limits.SetQueue)
WITH changed AS (
    INSERT INTO "aioq".queues AS q
        (name, max_running, rate_limit, rate_period, paused, max_running_per_key)
    SELECT $1, CASE WHEN $2 THEN $3::integer END,
           CASE WHEN $4 THEN $5::integer END,
           CASE WHEN $4 THEN make_interval(secs => $6::float8) END,
           $7 AND $8,
           CASE WHEN $11 THEN $12::integer END
    WHERE NOT $9
       OR EXISTS (SELECT FROM "aioq".queues WHERE name = $1)
       OR EXISTS (SELECT FROM "aioq".jobs WHERE queue = $1 AND status = 'pending')
       OR EXISTS (SELECT FROM "aioq".jobs WHERE queue = $1 AND status = 'running')
    ON CONFLICT (name) DO UPDATE
    SET max_running = CASE WHEN $2 THEN EXCLUDED.max_running ELSE q.max_running END,
        rate_limit = CASE WHEN $4 THEN EXCLUDED.rate_limit ELSE q.rate_limit END,
        rate_period = CASE WHEN $4 THEN EXCLUDED.rate_period ELSE q.rate_period END,
        paused = CASE WHEN $7 THEN EXCLUDED.paused ELSE q.paused END,
        max_running_per_key = CASE WHEN $11
                              THEN EXCLUDED.max_running_per_key
                              ELSE q.max_running_per_key END,
        updated_at = now()
    RETURNING q.name
),
rang AS (
    SELECT pg_notify($10, ''), pg_notify($10, name) FROM changed
)
SELECT name FROM changed WHERE (SELECT count(*) FROM rang) >= 0
