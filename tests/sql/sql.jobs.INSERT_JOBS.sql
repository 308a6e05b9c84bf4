-- aioq.sql.jobs.INSERT_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queue, $2 :task, $3 :priority, $4 :run_at, $5 :delay, $6 :max_attempts, $7 :lease, $8 :args, $9 :traceparent (the fields of aioq.sql.jobs.InsertJobs)
WITH ready_queues(queue) AS (
    SELECT $1::text WHERE coalesce($4::timestamptz, now() + make_interval(secs => $5::float8)) <= now() AND cardinality($8::text[]) > 0
),
rang AS (
    SELECT pg_notify('aioq:aioq', r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended(r.queue, '"aioq".jobs'::regclass::oid::bigint))
          THEN NOT (pg_try_advisory_lock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint))
                    AND pg_advisory_unlock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint)))
          ELSE true END
)
INSERT INTO "aioq".jobs (queue, task, args, priority, run_at, max_attempts, lease, traceparent)
SELECT $1, $2, a.args::jsonb, $3, coalesce($4::timestamptz, now() + make_interval(secs => $5::float8)), $6,
       make_interval(secs => $7::float8), $9
FROM unnest($8::text[]) WITH ORDINALITY AS a(args, n)
WHERE (SELECT count(*) FROM rang) >= 0
ORDER BY a.n
RETURNING id
