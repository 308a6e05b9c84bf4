-- aioq.sql.limits.CLAIM_LIMITED, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queue, $2 :limit, $3 :worker, $4 :unknown, $5 :grace (the fields of aioq.sql.limits.ClaimJobs)
WITH RECURSIVE counted_room AS MATERIALIZED (
    SELECT t.now, q.rate_limit, q.rate_period, q.paused, q.max_running_per_key AS per_key,
           extract(epoch FROM q.rate_period) / 10 AS slot_s,
           CASE WHEN q.max_running IS NOT NULL THEN q.max_running - (
               SELECT count(*) FROM "aioq".jobs WHERE queue = $1 AND status = 'running') END
               AS running_room,
           CASE WHEN q.rate_limit IS NOT NULL THEN q.rate_limit - (
               SELECT coalesce(sum(c.claims), 0) FROM "aioq".queue_claims AS c
               WHERE c.queue = $1 AND c.slot_end > t.now - q.rate_period) END AS rate_room
    FROM "aioq".queues AS q, (SELECT clock_timestamp() AS now) AS t
    WHERE q.name = $1
),
room AS MATERIALIZED (
    SELECT r.*,
           CASE WHEN r.paused THEN 0 ELSE greatest(0, least($2, r.running_room, r.rate_room))
           END AS n
    FROM counted_room AS r
),
plain AS (
    SELECT id FROM "aioq".jobs
    WHERE queue = $1 AND status = 'pending' AND run_at <= now() AND (unknown_since IS NULL OR task <> ALL($4::text[])
         OR unknown_since <= now() - make_interval(secs => $5::float8))
      AND (SELECT per_key FROM room) IS NULL
    ORDER BY priority DESC, run_at, id
    LIMIT (SELECT n FROM room)
    FOR UPDATE SKIP LOCKED
),
keys AS (
    (SELECT concurrency_key AS k FROM "aioq".jobs
     WHERE status = 'pending' AND queue = $1 AND concurrency_key IS NOT NULL
       AND (SELECT per_key FROM room) IS NOT NULL
     ORDER BY concurrency_key
     LIMIT 1)
    UNION ALL
    SELECT (SELECT j.concurrency_key FROM "aioq".jobs AS j
            WHERE j.status = 'pending' AND j.queue = $1 AND j.concurrency_key > keys.k
            ORDER BY j.concurrency_key
            LIMIT 1)
    FROM keys WHERE keys.k IS NOT NULL
),
per_key AS (
    SELECT p.id, p.priority, p.run_at,
           row_number() OVER (PARTITION BY keys.k ORDER BY priority DESC, run_at, id) AS turn
    FROM keys
    CROSS JOIN LATERAL (
        SELECT id, priority, run_at FROM "aioq".jobs
        WHERE queue = $1 AND concurrency_key = keys.k AND status = 'pending' AND run_at <= now() AND (unknown_since IS NULL OR task <> ALL($4::text[])
             OR unknown_since <= now() - make_interval(secs => $5::float8))
        ORDER BY priority DESC, run_at, id
        LIMIT greatest(0, least((SELECT n FROM room), (SELECT per_key FROM room) - (
            SELECT count(*) FROM "aioq".jobs AS r
            WHERE r.queue = $1 AND r.concurrency_key = keys.k AND r.status = 'running')))
        FOR UPDATE SKIP LOCKED
    ) AS p
    WHERE keys.k IS NOT NULL
),
unkeyed AS (
    SELECT j.id, j.priority, j.run_at FROM "aioq".jobs AS j
    WHERE j.id = ANY(ARRAY(
            SELECT id FROM "aioq".jobs
            WHERE queue = $1 AND status = 'pending' AND run_at <= now() AND (unknown_since IS NULL OR task <> ALL($4::text[])
                 OR unknown_since <= now() - make_interval(secs => $5::float8))
              AND (SELECT per_key FROM room) IS NOT NULL
              AND (SELECT count(*) FROM per_key WHERE turn = 1) < (SELECT n FROM room)
            ORDER BY priority DESC, run_at, id
            LIMIT 100))
      AND j.concurrency_key IS NULL AND j.status = 'pending'
    ORDER BY priority DESC, run_at, id
    LIMIT (SELECT n FROM room)
    FOR UPDATE SKIP LOCKED
),
keyed AS (
    SELECT id, priority, run_at, turn FROM per_key
    UNION ALL
    SELECT id, priority, run_at, row_number() OVER (ORDER BY priority DESC, run_at, id)
    FROM unkeyed
),
picked AS (
    SELECT id FROM plain
    UNION ALL
    (SELECT id FROM keyed ORDER BY priority DESC, turn, run_at, id LIMIT (SELECT n FROM room))
),
claimed AS (
    UPDATE "aioq".jobs AS j
    SET status = 'running', attempts = j.attempts + 1, claims = j.claims + 1, locked_by = $3,
        locked_at = (SELECT now FROM room), lease_expires_at = (SELECT now FROM room) + j.lease
    WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING j.id, j.claims, j.queue, j.task, j.args::text AS args, j.priority, j.attempts,
              j.max_attempts, j.snoozes, extract(epoch FROM j.lease)::float8 AS lease,
              extract(epoch FROM j.locked_at - j.run_at)::float8 AS waited, j.traceparent,
              j.scheduled_at, j.workflow_id,
              extract(epoch FROM now() - j.unknown_since)::float8 AS unknown_for
),
counted AS (
    INSERT INTO "aioq".queue_claims AS c (queue, slot_start, slot_end, claims)
    SELECT $1, s.start, s.start + make_interval(secs => r.slot_s), n.claimed
    FROM room AS r
    CROSS JOIN LATERAL (
        SELECT to_timestamp(floor(extract(epoch FROM r.now) / r.slot_s) * r.slot_s) AS start
    ) AS s
    CROSS JOIN (SELECT count(*) AS claimed FROM claimed) AS n
    WHERE r.rate_limit IS NOT NULL AND n.claimed > 0
    ON CONFLICT (queue, slot_start) DO UPDATE
    SET claims = c.claims + EXCLUDED.claims, slot_end = greatest(c.slot_end, EXCLUDED.slot_end)
),
pruned AS (
    DELETE FROM "aioq".queue_claims AS c
    USING room AS r
    WHERE c.queue = $1 AND c.slot_end <= r.now - coalesce(r.rate_period, interval '0')
)
SELECT c.*, r.rate_room,
       CASE WHEN r.paused THEN 0 ELSE greatest(0, least(r.running_room, r.rate_room)) END AS room
FROM room AS r LEFT JOIN claimed AS c ON true
