-- aioq.sql.doorbell.ARM_DOORBELL, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :standby, $2 :duty, $3 :probe, $4 :handover
WITH standby AS MATERIALIZED (
    SELECT count(pg_advisory_lock_shared(hashtextextended(s, ~'"aioq".jobs'::regclass::oid::bigint))) AS n
    FROM unnest($1::text[]) AS s
), tried AS MATERIALIZED (
    SELECT t.queue, t.key, t.duty,
           CASE WHEN t.duty THEN true
                ELSE NOT (pg_try_advisory_lock_shared(t.key)
                          AND pg_advisory_unlock_shared(t.key)) END AS covered
    FROM standby, LATERAL (
        SELECT k.q, k.key, pg_try_advisory_lock(k.key)
        FROM (SELECT q, hashtextextended(q, '"aioq".jobs'::regclass::oid::bigint) FROM unnest($2::text[]) AS q) AS k(q, key)
        WHERE standby.n >= 0 OFFSET 0
    ) AS t(queue, key, duty)
)
SELECT queue, key, duty, covered FROM tried
UNION ALL
SELECT p.queue, p.key, false,
       CASE WHEN NOT pg_try_advisory_lock(p.key)
                THEN NOT (pg_try_advisory_lock_shared(p.key) AND pg_advisory_unlock_shared(p.key))
            WHEN NOT pg_advisory_unlock(p.key) THEN true  -- never: it was just taken
            WHEN pg_try_advisory_lock(hashtextextended(p.queue, ~'"aioq".jobs'::regclass::oid::bigint))
                THEN pg_advisory_unlock(hashtextextended(p.queue, ~'"aioq".jobs'::regclass::oid::bigint))
            ELSE (SELECT true FROM pg_notify($4, p.key::text)) END
FROM (SELECT count(*) AS n FROM tried) AS done, LATERAL (
    SELECT q, hashtextextended(q, '"aioq".jobs'::regclass::oid::bigint) FROM unnest($3::text[]) AS q
    WHERE done.n >= 0 OFFSET 0
) AS p(queue, key)
