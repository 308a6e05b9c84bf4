-- aioq.sql.jobs.INSERT_UNIQUE_JOB_FOR, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queue, $2 :task, $3 :args, $4 :priority, $5 :run_at, $6 :delay, $7 :max_attempts, $8 :lease, $9 :traceparent, $10 :unique_key, $11 :unique_for, $12 :replace, $13 :concurrency_key (the fields of aioq.sql.jobs.InsertUniqueJobFor)
WITH live AS (
    SELECT id FROM "aioq".jobs
    WHERE unique_key = $10 AND status IN ('pending', 'running')
),
replaced AS (
    UPDATE "aioq".jobs AS j
    SET args = $3::text::jsonb, run_at = coalesce($5::timestamptz, now() + make_interval(secs => $6::float8))
    FROM live
    WHERE $12 AND j.id = live.id AND j.status = 'pending'
    RETURNING j.id, j.run_at
),
gate AS (
    INSERT INTO "aioq".uniques AS u (key, job_id, expires_at)
    SELECT $10, nextval(pg_get_serial_sequence('"aioq".jobs', 'id')),
           now() + make_interval(secs => $11::float8)
    WHERE $11::float8 IS NOT NULL AND NOT EXISTS (SELECT FROM live)
    ON CONFLICT (key) DO UPDATE SET job_id = EXCLUDED.job_id, expires_at = EXCLUDED.expires_at
    WHERE u.expires_at <= now()
    RETURNING job_id
),
inserted AS (
    INSERT INTO "aioq".jobs (id, queue, task, args, priority, run_at, max_attempts, lease,
                              traceparent, unique_key, concurrency_key)
    OVERRIDING SYSTEM VALUE
    SELECT g.id, $1, $2, $3::text::jsonb, $4, coalesce($5::timestamptz, now() + make_interval(secs => $6::float8)), $7,
           make_interval(secs => $8::float8), $9, $10, $13
    FROM (SELECT job_id AS id FROM gate
          UNION ALL
          SELECT nextval(pg_get_serial_sequence('"aioq".jobs', 'id'))
          WHERE $11::float8 IS NULL AND NOT EXISTS (SELECT FROM live)) AS g
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND status IN ('pending', 'running')
    DO NOTHING
    RETURNING id, run_at
),
ready_queues(queue) AS (
    SELECT $1::text
    WHERE EXISTS (SELECT FROM inserted WHERE run_at <= now())
       OR EXISTS (SELECT FROM replaced WHERE run_at <= now())
),
rang AS (
    SELECT pg_notify('aioq:aioq', r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended(r.queue, '"aioq".jobs'::regclass::oid::bigint))
          THEN NOT (pg_try_advisory_lock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint))
                    AND pg_advisory_unlock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint)))
          ELSE true END
)
SELECT id FROM inserted WHERE (SELECT count(*) FROM rang) >= 0
UNION ALL
SELECT id FROM live WHERE (SELECT count(*) FROM rang) >= 0
UNION ALL
SELECT job_id FROM "aioq".uniques
WHERE key = $10 AND expires_at > now() AND $11::float8 IS NOT NULL
  AND NOT EXISTS (SELECT FROM live) AND NOT EXISTS (SELECT FROM gate)
LIMIT 1
