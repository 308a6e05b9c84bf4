-- aioq.sql.admin.REPLAY, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :ids, $2 :task, $3 :queue
WITH RECURSIVE locked AS (  -- in id order, as cancel and the fenced writes: never a deadlock
    SELECT j.id, j.queue, j.unique_key FROM "aioq".jobs AS j
    WHERE j.status = 'dead'
      AND ($1::bigint[] IS NULL OR j.id = ANY($1))
      AND ($2::text IS NULL OR j.task = $2)
      AND ($3::text IS NULL OR j.queue = $3)
    ORDER BY j.id
    FOR UPDATE
),
matching AS (
    SELECT l.id, l.unique_key, max(l.id) OVER (PARTITION BY l.unique_key) AS newest,
           (SELECT live.id FROM "aioq".jobs AS live
            WHERE live.unique_key = l.unique_key AND live.status IN ('pending', 'running')
            LIMIT 1) AS live_id
    FROM locked AS l
),
changed AS (
    UPDATE "aioq".jobs AS j
    SET status = 'pending', attempts = 0, run_at = now(),
        cancel_requested_at = NULL  -- a request that came too late ended with the run
    FROM matching AS m
    WHERE j.id = m.id AND (m.unique_key IS NULL OR (m.live_id IS NULL AND m.id = m.newest))
    RETURNING j.id, j.queue, j.status, j.workflow_id
),
revived(root, job_id) AS (
    SELECT id, id FROM changed WHERE workflow_id IS NOT NULL
    UNION
    SELECT r.root, b.id
    FROM revived AS r
    JOIN "aioq".workflow_deps AS d ON d.parent_id = r.job_id
    JOIN "aioq".jobs AS b ON b.id = d.job_id AND b.blocked_by = r.job_id
                              AND b.status = 'cancelled'
),
ready_queues(queue) AS (SELECT queue FROM changed WHERE status = 'pending' GROUP BY queue),
rang AS (
    SELECT pg_notify('aioq:aioq', r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended(r.queue, '"aioq".jobs'::regclass::oid::bigint))
          THEN NOT (pg_try_advisory_lock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint))
                    AND pg_advisory_unlock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint)))
          ELSE true END
)
SELECT m.id, m.unique_key, c.id IS NOT NULL AS replayed, m.live_id, m.newest,
       ARRAY(SELECT r.job_id FROM revived AS r
             WHERE r.root = m.id AND r.job_id <> r.root ORDER BY r.job_id) AS revived,
       ARRAY(SELECT w.name FROM revived AS r
             JOIN "aioq".workflow_steps AS w ON w.job_id = r.job_id
             WHERE r.root = m.id AND r.job_id <> r.root ORDER BY r.job_id) AS revived_names
FROM matching AS m
LEFT JOIN changed AS c ON c.id = m.id
WHERE (SELECT count(*) FROM rang) >= 0
ORDER BY m.id
