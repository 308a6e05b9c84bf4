-- aioq.sql.admin.PENDING_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :task
SELECT id, queue, args::text AS args, priority, run_at, attempts, max_attempts, unique_key
FROM "aioq".jobs WHERE status = 'pending' AND task = $1
ORDER BY run_at, id
