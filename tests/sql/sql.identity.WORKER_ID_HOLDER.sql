-- aioq.sql.identity.WORKER_ID_HOLDER, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :worker
SELECT l.pid, host(a.client_addr) AS address, a.application_name, a.backend_start AS since
FROM pg_locks AS l
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint)
      = hashtextextended($1::text, '"aioq".jobs'::regclass::oid::bigint)
LIMIT 1
