-- aioq.sql.doorbell.DISARM_DOORBELL, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :duty, $2 :standby, $3 :handover
WITH unlocked AS MATERIALIZED (
    SELECT count(pg_advisory_unlock(hashtextextended(q, '"aioq".jobs'::regclass::oid::bigint))) AS n
    FROM unnest($1::text[]) AS q
), resting AS MATERIALIZED (
    SELECT count(pg_advisory_unlock_shared(hashtextextended(s, ~'"aioq".jobs'::regclass::oid::bigint))) AS n
    FROM unnest($2::text[]) AS s
)
SELECT pg_notify($3, hashtextextended(t.q, '"aioq".jobs'::regclass::oid::bigint)::text)
FROM unlocked, resting, LATERAL (
    SELECT q FROM unnest($1::text[]) AS q WHERE unlocked.n + resting.n >= 0 OFFSET 0
) AS t
WHERE NOT (pg_try_advisory_lock(hashtextextended(t.q, ~'"aioq".jobs'::regclass::oid::bigint))
           AND pg_advisory_unlock(hashtextextended(t.q, ~'"aioq".jobs'::regclass::oid::bigint)))
