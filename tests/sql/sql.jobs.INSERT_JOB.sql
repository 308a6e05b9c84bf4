-- aioq.sql.jobs.INSERT_JOB, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queue, $2 :task, $3 :args, $4 :priority, $5 :run_at, $6 :delay, $7 :max_attempts, $8 :lease, $9 :traceparent (the fields of aioq.sql.jobs.InsertJob)
WITH ready_queues(queue) AS (SELECT $1::text WHERE coalesce($5::timestamptz, now() + make_interval(secs => $6::float8)) <= now()),
rang AS (
    SELECT pg_notify('aioq:aioq', r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended(r.queue, '"aioq".jobs'::regclass::oid::bigint))
          THEN NOT (pg_try_advisory_lock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint))
                    AND pg_advisory_unlock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint)))
          ELSE true END
)
INSERT INTO "aioq".jobs (queue, task, args, priority, run_at, max_attempts, lease, traceparent)
SELECT $1, $2, $3::text::jsonb, $4, coalesce($5::timestamptz, now() + make_interval(secs => $6::float8)), $7,
       make_interval(secs => $8::float8), $9
WHERE (SELECT count(*) FROM rang) >= 0
RETURNING id
