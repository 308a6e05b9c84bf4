-- aioq.sql.outcomes.WRITE_STEP_OUTCOMES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :ids, $2 :claims, $3 :worker, $4 :kinds, $5 :delays, $6 :errors, $7 :results, $8 :ttls, $9 :archive, $10 :results_channel (the fields of aioq.sql.outcomes.WriteOutcomes)
WITH mine AS (
    SELECT j.id, f.kind, f.delay, f.error, f.result, f.ttl
    FROM (SELECT * FROM unnest($1::bigint[], $2::integer[], $4::text[],
                               $5::float8[], $6::text[], $7::text[],
                               $8::float8[])
          AS u(id, claim, kind, delay, error, result, ttl) ORDER BY id) AS f
    CROSS JOIN LATERAL (
        -- By primary key whatever the statistics say; OFFSET 0 keeps the fence's status test
        -- out of this lookup (it would pick the running rows' index).
        SELECT j.id, j.claims, j.locked_by, j.status, j.cancel_requested_at FROM "aioq".jobs AS j
        WHERE j.id = f.id
        OFFSET 0
        FOR UPDATE
    ) AS j
    WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
),
done AS (
    DELETE FROM "aioq".jobs AS j
    WHERE j.id = ANY(ARRAY(SELECT id FROM mine WHERE kind = 'succeeded'))
    RETURNING j.id, j.claims AS claim
),
succeeded AS (
    SELECT j.id, j.queue, j.task, j.args, j.priority, j.attempts, j.max_attempts, j.locked_by,
           j.locked_at, j.created_at, j.progress, j.progress_note, m.result, m.ttl
    FROM mine AS m
    CROSS JOIN LATERAL (
        SELECT j.id, j.queue, j.task, j.args, j.priority, j.attempts, j.max_attempts,
               j.locked_by, j.locked_at, j.created_at, j.progress, j.progress_note
        FROM "aioq".jobs AS j
        WHERE j.id = m.id
        OFFSET 0
    ) AS j
    WHERE m.kind = 'succeeded' AND (m.ttl IS NOT NULL OR $9::boolean)
),
kept AS (
    INSERT INTO "aioq".results (id, queue, task, args, priority, attempts, max_attempts,
                                 worker, progress, progress_note, created_at, started_at,
                                 finished_at, expires_at, result)
    SELECT id, queue, task, args, priority, attempts, max_attempts, locked_by, progress,
           progress_note, created_at, locked_at, clock_timestamp(),
           clock_timestamp() + make_interval(secs => ttl), result::jsonb
    FROM succeeded WHERE ttl IS NOT NULL
    RETURNING id
),
archived AS (
    INSERT INTO "aioq".archive (id, queue, task, args, priority, attempts, max_attempts,
                                 worker, created_at, started_at, finished_at)
    SELECT id, queue, task, args, priority, attempts, max_attempts, locked_by,
           created_at, locked_at, clock_timestamp()
    FROM succeeded WHERE $9::boolean
),
outcomes AS (
    SELECT coalesce(jsonb_object_agg(id::text, jsonb_build_object(
               'kind', kind, 'delay', delay, 'error', error, 'ttl', ttl)), '{}') AS by_id
    FROM mine
    WHERE kind <> 'succeeded'
),
changed AS (
    UPDATE "aioq".jobs AS j
    SET (status, run_at, last_error, attempts, max_attempts, snoozes, cancel_requested_at,
         unknown_since) = (
        SELECT CASE m.kind WHEN 'dead' THEN 'dead' WHEN 'cancelled' THEN 'cancelled'
                    ELSE CASE WHEN j.cancel_requested_at IS NULL THEN 'pending' ELSE 'cancelled' END END,
               now() + make_interval(secs => m.delay),
               CASE WHEN m.kind IN ('retried', 'dead') THEN coalesce(m.error, j.last_error)
                    ELSE j.last_error END,
               j.attempts - CASE WHEN m.kind IN ('released', 'unknown_task') THEN 1 ELSE 0 END,
               j.max_attempts + CASE WHEN m.kind = 'snoozed' THEN 1 ELSE 0 END,
               j.snoozes + CASE WHEN m.kind = 'snoozed' THEN 1 ELSE 0 END,
               CASE WHEN m.kind = 'cancelled' THEN coalesce(j.cancel_requested_at, now())
                    ELSE j.cancel_requested_at END,
               CASE m.kind WHEN 'unknown_task' THEN coalesce(j.unknown_since, now())
                           WHEN 'released' THEN j.unknown_since END
        FROM jsonb_to_record(o.by_id -> j.id::text)
             AS m(kind text, delay float8, error text, ttl float8)
    ),
        last_worker = j.locked_by, locked_by = NULL, locked_at = NULL,
        lease_expires_at = NULL
    FROM outcomes AS o
    WHERE j.id = ANY(ARRAY(SELECT id FROM mine WHERE kind <> 'succeeded'))
    RETURNING j.id, j.claims AS claim, j.queue, j.status,
              (o.by_id -> j.id::text ->> 'delay')::float8 AS delay,
              o.by_id -> j.id::text ->> 'ttl' IS NOT NULL AS awaited
),
told AS (
    SELECT pg_notify($10, id::text) FROM kept
    UNION ALL
    SELECT pg_notify($10, id::text) FROM changed
    WHERE awaited AND status <> 'pending'
),
recorded AS (
    UPDATE "aioq".workflow_steps AS w
    SET succeeded_at = clock_timestamp(), result = coalesce(r.result, 'null')::jsonb
    FROM (SELECT m.id, m.result FROM done JOIN mine AS m ON m.id = done.id) AS r
    WHERE w.job_id = ANY(ARRAY(SELECT id FROM done)) AND w.job_id = r.id
    RETURNING w.job_id, w.workflow_id
),
counted AS (
    SELECT d.job_id, count(*)::integer AS n
    FROM "aioq".workflow_deps AS d
    WHERE d.parent_id = ANY(ARRAY(SELECT id FROM done))
    GROUP BY d.job_id
),
dependents AS (
    SELECT w.job_id FROM "aioq".workflow_steps AS w
    WHERE w.job_id = ANY(ARRAY(SELECT job_id FROM counted))
    ORDER BY w.job_id
    FOR UPDATE OF w
),
decremented AS (
    UPDATE "aioq".workflow_steps AS w SET remaining = w.remaining - c.n
    FROM counted AS c
    WHERE w.job_id = ANY(ARRAY(SELECT job_id FROM dependents)) AND w.job_id = c.job_id
    RETURNING w.job_id, w.remaining, w.delay
),
met AS (
    UPDATE "aioq".jobs AS j SET status = 'pending',
        run_at = CASE WHEN d.delay IS NULL THEN greatest(j.run_at, now()) ELSE now() + d.delay END
    FROM decremented AS d
    WHERE j.id = ANY(ARRAY(SELECT job_id FROM decremented WHERE remaining <= 0))
      AND j.id = d.job_id AND j.status = 'waiting'
    RETURNING j.queue, j.run_at
),
runs AS (
    SELECT w.id, c.n FROM "aioq".workflows AS w
    JOIN (SELECT workflow_id, count(*)::integer AS n FROM recorded GROUP BY workflow_id) AS c
         ON c.workflow_id = w.id
    ORDER BY w.id
    FOR UPDATE OF w
),
progressed AS (
    UPDATE "aioq".workflows AS w SET succeeded = w.succeeded + r.n
    FROM runs AS r
    WHERE w.id = r.id
),
ready_queues(queue) AS (
    SELECT queue FROM changed WHERE status = 'pending' AND delay = 0
    UNION SELECT queue FROM met WHERE run_at <= now()
),
rang AS (
    SELECT pg_notify('aioq:aioq', r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended(r.queue, '"aioq".jobs'::regclass::oid::bigint))
          THEN NOT (pg_try_advisory_lock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint))
                    AND pg_advisory_unlock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint)))
          ELSE true END
)
SELECT id, claim FROM (SELECT id, claim FROM done UNION ALL SELECT id, claim FROM changed)
    AS written
WHERE (SELECT count(*) FROM rang) >= 0 AND (SELECT count(*) FROM told) >= 0
  AND (SELECT count(*) FROM recorded) >= 0
