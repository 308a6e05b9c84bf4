-- aioq.sql.admin.GET_JOB, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :id
SELECT id, queue, task, args::text AS args, status, priority, run_at, attempts,
       max_attempts, extract(epoch FROM lease)::float8 AS lease, locked_by, locked_at,
       lease_expires_at, last_error, unique_key, created_at, cancel_requested_at, progress,
       progress_note, NULL::text AS result, last_worker, workflow_id, unknown_since, NULL::timestamptz AS finished_at
FROM "aioq".jobs WHERE id = $1
UNION ALL
SELECT id, queue, task, args::text, 'succeeded', priority, started_at, attempts, max_attempts,
       NULL, worker, started_at, NULL, NULL, NULL, created_at, NULL, progress, progress_note,
       result::text, worker, NULL, NULL, finished_at
FROM "aioq".results WHERE id = $1
LIMIT 1
