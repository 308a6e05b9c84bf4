-- aioq.sql.doorbell.ARM_DOORBELL, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :standby, $2 :duty
WITH standby AS MATERIALIZED (
    SELECT count(pg_advisory_lock_shared(~'"aioq".jobs'::regclass::oid::int, hashtext(s))) AS n
    FROM unnest($1::text[]) AS s
)
SELECT t.queue, t.duty,
       CASE WHEN t.duty THEN true
            ELSE NOT (pg_try_advisory_lock_shared('"aioq".jobs'::regclass::oid::int, hashtext(t.queue))
                      AND pg_advisory_unlock_shared('"aioq".jobs'::regclass::oid::int, hashtext(t.queue))) END AS covered
FROM standby, LATERAL (
    SELECT q, pg_try_advisory_lock('"aioq".jobs'::regclass::oid::int, hashtext(q)) FROM unnest($2::text[]) AS q
    WHERE standby.n >= 0 OFFSET 0
) AS t(queue, duty)
