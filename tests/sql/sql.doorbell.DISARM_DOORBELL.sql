-- aioq.sql.doorbell.DISARM_DOORBELL, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :standby, $2 :duty
WITH unlocked AS MATERIALIZED (
    SELECT count(pg_advisory_unlock('"aioq".jobs'::regclass::oid::int, hashtext(q))) AS n FROM unnest($2::text[]) AS q
), resting AS MATERIALIZED (
    SELECT count(pg_advisory_unlock_shared(~'"aioq".jobs'::regclass::oid::int, hashtext(s))) AS n
    FROM unnest($1::text[]) AS s
)
SELECT pg_notify('aioq:aioq', t.q)
FROM unlocked, resting, LATERAL (
    SELECT q FROM unnest($2::text[]) AS q WHERE unlocked.n + resting.n >= 0 OFFSET 0
) AS t
WHERE NOT (pg_try_advisory_lock(~'"aioq".jobs'::regclass::oid::int, hashtext(t.q))
           AND pg_advisory_unlock(~'"aioq".jobs'::regclass::oid::int, hashtext(t.q)))
