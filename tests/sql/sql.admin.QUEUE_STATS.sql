-- aioq.sql.admin.QUEUE_STATS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT queue,
       count(*) FILTER (WHERE status = 'pending' AND run_at <= now()) AS ready,
       count(*) FILTER (WHERE status = 'pending' AND run_at > now()) AS scheduled,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
       count(*) FILTER (WHERE status = 'running' AND lease_expires_at < now()) AS expired,
       coalesce(extract(epoch FROM now() - min(run_at)
                FILTER (WHERE status = 'pending' AND run_at <= now())), 0)::float8
           AS oldest_ready_age,
       count(*) FILTER (WHERE status = 'waiting') AS waiting
FROM "aioq".jobs
GROUP BY queue
ORDER BY queue
