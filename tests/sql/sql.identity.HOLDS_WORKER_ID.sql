-- aioq.sql.identity.HOLDS_WORKER_ID, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :worker
SELECT EXISTS (
    SELECT FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted AND l.objsubid = 1
      AND ((l.classid::bigint << 32) | l.objid::bigint)
          = hashtextextended($1::text, '"aioq".jobs'::regclass::oid::bigint)
)
