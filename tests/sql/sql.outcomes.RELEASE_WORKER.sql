-- aioq.sql.outcomes.RELEASE_WORKER, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :worker, $2 :ids
WITH mine AS (
    SELECT id FROM "aioq".jobs
    WHERE locked_by = $1 AND status = 'running' AND id <> ALL($2::bigint[])
    ORDER BY id
    FOR UPDATE
),
changed AS (
    UPDATE "aioq".jobs AS j
    SET status = CASE WHEN j.cancel_requested_at IS NULL THEN 'pending' ELSE 'cancelled' END, run_at = now(),
        attempts = greatest(j.attempts - 1, 0),
        last_worker = j.locked_by, locked_by = NULL, locked_at = NULL,
        lease_expires_at = NULL
    WHERE j.id = ANY(ARRAY(SELECT id FROM mine))
    RETURNING j.id, j.queue, j.status
),
ready_queues(queue) AS (SELECT queue FROM changed WHERE status = 'pending' GROUP BY queue),
rang AS (
    SELECT pg_notify('aioq:aioq', r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended(r.queue, '"aioq".jobs'::regclass::oid::bigint))
          THEN NOT (pg_try_advisory_lock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint))
                    AND pg_advisory_unlock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint)))
          ELSE true END
)
SELECT id FROM changed WHERE (SELECT count(*) FROM rang) >= 0
