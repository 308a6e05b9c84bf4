-- aioq.sql.doorbell.RING, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queue
WITH ready_queues(queue) AS (SELECT $1::text),
rang AS (
    SELECT pg_notify('aioq:aioq', r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE NOT pg_try_advisory_xact_lock_shared('"aioq".jobs'::regclass::oid::int, hashtext(r.queue))
)
SELECT count(*) FROM rang
