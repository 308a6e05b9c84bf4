-- aioq.sql.outcomes.RESCUE_EXPIRED, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :limit, $2 :worker
WITH expired AS (
    SELECT id FROM "aioq".jobs
    WHERE status = 'running' AND lease_expires_at < now()
      AND locked_by IS DISTINCT FROM $2::text
    ORDER BY lease_expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
changed AS (
    UPDATE "aioq".jobs AS j
    SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                      WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'pending' END,
        run_at = now(),
        last_error = CASE WHEN j.cancel_requested_at IS NOT NULL AND j.last_error LIKE 'cancelled:%'
                          THEN j.last_error
                          ELSE format('LeaseExpired: worker %s held attempt %s past its lease',
                                      j.locked_by, j.attempts) END,
        last_worker = j.locked_by, locked_by = NULL, locked_at = NULL,
        lease_expires_at = NULL
    WHERE j.id = ANY(ARRAY(SELECT id FROM expired))
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
SELECT id, status FROM changed WHERE (SELECT count(*) FROM rang) >= 0
