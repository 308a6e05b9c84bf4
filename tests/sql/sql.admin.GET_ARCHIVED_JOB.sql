-- aioq.sql.admin.GET_ARCHIVED_JOB, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :id
SELECT id, queue, task, args::text AS args, 'succeeded' AS status, priority,
       started_at AS run_at, attempts, max_attempts, NULL::float8 AS lease,
       worker AS locked_by, started_at AS locked_at, NULL::timestamptz AS lease_expires_at,
       NULL::text AS last_error, NULL::text AS unique_key, created_at, finished_at,
       worker AS last_worker
FROM "aioq".archive
WHERE id = $1
