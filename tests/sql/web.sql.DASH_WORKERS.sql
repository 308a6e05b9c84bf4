-- aioq.web.sql.DASH_WORKERS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :cap, $2 :limit
SELECT coalesce(w.id, r.locked_by) AS id, w.host, w.pid, w.queues, w.concurrency,
       w.started_at, extract(epoch FROM now() - w.last_seen)::float8 AS seen_ago,
       coalesce(r.running, 0) AS running,
       extract(epoch FROM r.lease_end - now())::float8 AS lease_left
FROM "aioq".workers AS w
FULL JOIN (
    SELECT locked_by, count(*) AS running, max(lease_expires_at) AS lease_end
    FROM (SELECT locked_by, lease_expires_at FROM "aioq".jobs
          WHERE status = 'running' LIMIT $1) AS x
    GROUP BY locked_by
) AS r ON r.locked_by = w.id
ORDER BY w.last_seen DESC NULLS LAST, 1
LIMIT $2
