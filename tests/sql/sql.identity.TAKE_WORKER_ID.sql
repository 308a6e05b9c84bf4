-- aioq.sql.identity.TAKE_WORKER_ID, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :worker
SELECT pg_try_advisory_lock(hashtextextended($1::text, '"aioq".jobs'::regclass::oid::bigint))
