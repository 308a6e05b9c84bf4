-- aioq.sql.admin.LIST_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :status, $2 :task, $3 :queue, $4 :limit
SELECT id, queue, task, args::text AS args, status, priority, run_at, attempts,
       max_attempts, extract(epoch FROM lease)::float8 AS lease, locked_by, locked_at,
       lease_expires_at, last_error, unique_key, created_at, cancel_requested_at, progress,
       progress_note, NULL::text AS result, last_worker, workflow_id, unknown_since
FROM "aioq".jobs
WHERE ($1::text IS NULL OR status = $1)
  AND ($2::text IS NULL OR task = $2)
  AND ($3::text IS NULL OR queue = $3)
ORDER BY id
LIMIT $4
