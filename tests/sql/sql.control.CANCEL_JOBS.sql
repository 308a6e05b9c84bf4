-- aioq.sql.control.CANCEL_JOBS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :ids, $2 :control_channel, $3 :results_channel, $4 :reason
WITH wanted AS (
    SELECT DISTINCT id FROM unnest($1::bigint[]) AS w(id)
),
locked AS (  -- in id order, like the fenced writes: two statements never deadlock
    SELECT j.id FROM "aioq".jobs AS j
    WHERE j.id IN (SELECT id FROM wanted) AND j.status IN ('pending', 'waiting', 'running')
    ORDER BY j.id
    FOR UPDATE OF j
),
changed AS (
    UPDATE "aioq".jobs AS j
    SET status = CASE WHEN j.status = 'running' THEN j.status ELSE 'cancelled' END,
        run_at = CASE WHEN j.status = 'running' THEN j.run_at ELSE now() END,
        cancel_requested_at = coalesce(j.cancel_requested_at, now()),
        last_error = coalesce($4::text, j.last_error)
    FROM locked
    WHERE j.id = locked.id AND j.status IN ('pending', 'waiting', 'running')
    RETURNING j.id, j.status
),
rang AS (
    SELECT pg_notify(CASE WHEN status = 'running' THEN $2 ELSE $3 END,
                     id::text)
    FROM changed
)
SELECT w.id,
       CASE WHEN c.status = 'cancelled' THEN 'cancelled'
            WHEN c.status = 'running' THEN 'cancelling'
            WHEN j.status IN ('dead', 'cancelled') THEN j.status
            WHEN j.status IS NOT NULL THEN 'raced'
            WHEN EXISTS (SELECT FROM "aioq".results AS r WHERE r.id = w.id)
              OR EXISTS (SELECT FROM "aioq".archive AS a WHERE a.id = w.id) THEN 'finished'
            ELSE 'missing'
       END AS state
FROM wanted AS w
LEFT JOIN changed AS c ON c.id = w.id
LEFT JOIN "aioq".jobs AS j ON j.id = w.id
WHERE (SELECT count(*) FROM rang) >= 0
ORDER BY w.id
