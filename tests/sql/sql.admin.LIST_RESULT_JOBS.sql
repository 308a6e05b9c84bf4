-- aioq.sql.admin.LIST_RESULT_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :task, $2 :queue, $3 :limit
SELECT id, queue, task, args::text AS args, 'succeeded' AS status, priority, started_at AS run_at,
       attempts, max_attempts, NULL::float8 AS lease, worker AS locked_by,
       started_at AS locked_at, NULL::timestamptz AS lease_expires_at, NULL::text AS last_error,
       NULL::text AS unique_key, created_at, finished_at, progress, progress_note,
       result::text AS result, worker AS last_worker
FROM "aioq".results
WHERE ($1::text IS NULL OR task = $1)
  AND ($2::text IS NULL OR queue = $2)
  AND expires_at > now()
ORDER BY id
LIMIT $3
