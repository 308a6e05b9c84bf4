-- aioq.sql.schedules.SCHEDULE_TICK, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :name, $2 :task, $3 :queue, $4 :spec, $5 :ticks, $6 :next_tick, $7 :args, $8 :priority, $9 :max_attempts, $10 :lease (the fields of aioq.sql.schedules.ScheduleTick)
WITH advanced AS (
    UPDATE "aioq".schedules
    SET task = $2, queue = $3, spec = $4,
        last_tick = ($5::timestamptz[])[cardinality($5::timestamptz[])],
        next_tick = $6, ticked = true, updated_at = now()
    WHERE name = $1 AND last_tick < ($5::timestamptz[])[1]
    RETURNING name
),
ready_queues(queue) AS (
    SELECT $3::text
    WHERE EXISTS (SELECT FROM advanced) AND ($5::timestamptz[])[1] <= now()
),
rang AS (
    SELECT pg_notify('aioq:aioq', r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended(r.queue, '"aioq".jobs'::regclass::oid::bigint))
          THEN NOT (pg_try_advisory_lock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint))
                    AND pg_advisory_unlock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint)))
          ELSE true END
)
INSERT INTO "aioq".jobs (queue, task, args, priority, run_at, max_attempts, lease, scheduled_at)
SELECT $3, $2, $7::text::jsonb, $8, t.tick, $9,
       make_interval(secs => $10::float8), t.tick
FROM unnest($5::timestamptz[]) WITH ORDINALITY AS t(tick, n)
WHERE EXISTS (SELECT FROM advanced) AND (SELECT count(*) FROM rang) >= 0
ORDER BY t.n
RETURNING id
