-- aioq.sql.doorbell.RESET_DOORBELL, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :duty, $2 :handover
WITH released AS MATERIALIZED (
    SELECT count(*) AS n FROM (SELECT pg_advisory_unlock_all()) AS a
)
SELECT pg_notify($2, hashtextextended(t.q, '"aioq".jobs'::regclass::oid::bigint)::text)
FROM released, LATERAL (
    SELECT q FROM unnest($1::text[]) AS q WHERE released.n >= 0 OFFSET 0
) AS t
WHERE NOT (pg_try_advisory_lock(hashtextextended(t.q, ~'"aioq".jobs'::regclass::oid::bigint))
           AND pg_advisory_unlock(hashtextextended(t.q, ~'"aioq".jobs'::regclass::oid::bigint)))
