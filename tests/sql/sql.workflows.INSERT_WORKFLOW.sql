-- aioq.sql.workflows.INSERT_WORKFLOW, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :name, $2 :ids, $3 :queues, $4 :tasks, $5 :args, $6 :priorities, $7 :run_ats, $8 :delays, $9 :max_attempts, $10 :leases, $11 :concurrency_keys, $12 :names, $13 :remaining, $14 :on_failure, $15 :edge_steps, $16 :edge_parents, $17 :traceparent (the fields of aioq.sql.workflows.InsertWorkflow)
WITH run AS (
    INSERT INTO "aioq".workflows (name, steps) VALUES ($1, cardinality($2::bigint[]))
    RETURNING id
),
steps AS (
    SELECT * FROM unnest($2::bigint[], $3::text[], $4::text[], $5::text[],
                         $6::integer[], $7::timestamptz[], $8::float8[],
                         $9::integer[], $10::float8[],
                         $11::text[], $12::text[], $13::integer[],
                         $14::text[])
        WITH ORDINALITY AS s(id, queue, task, args, priority, run_at, delay, max_attempts,
                             lease, concurrency_key, name, remaining, on_failure, n)
),
inserted AS (
    INSERT INTO "aioq".jobs (id, queue, task, args, status, priority, run_at, max_attempts,
                              lease, concurrency_key, workflow_id, traceparent)
    OVERRIDING SYSTEM VALUE
    SELECT s.id, s.queue, s.task, s.args::jsonb,
           CASE WHEN s.remaining > 0 THEN 'waiting' ELSE 'pending' END, s.priority,
           coalesce(s.run_at, now() + make_interval(secs => s.delay)), s.max_attempts,
           make_interval(secs => s.lease), s.concurrency_key, run.id, $17::text
    FROM steps AS s CROSS JOIN run
    ORDER BY s.n
),
step_rows AS (
    INSERT INTO "aioq".workflow_steps (job_id, workflow_id, name, task, remaining, on_failure,
                                        delay)
    SELECT s.id, run.id, s.name, s.task, s.remaining, s.on_failure,
           CASE WHEN s.remaining > 0 AND s.run_at IS NULL AND s.delay > 0
                THEN make_interval(secs => s.delay) END
    FROM steps AS s CROSS JOIN run
),
edges AS (
    INSERT INTO "aioq".workflow_deps (job_id, parent_id)
    SELECT e.job_id, e.parent_id
    FROM unnest($15::bigint[], $16::bigint[]) AS e(job_id, parent_id)
),
ready_queues(queue) AS (
    SELECT DISTINCT queue FROM steps
    WHERE remaining = 0 AND coalesce(run_at, now() + make_interval(secs => delay)) <= now()
),
rang AS (
    SELECT pg_notify('aioq:aioq', r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended(r.queue, '"aioq".jobs'::regclass::oid::bigint))
          THEN NOT (pg_try_advisory_lock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint))
                    AND pg_advisory_unlock_shared(hashtextextended('', '"aioq".jobs'::regclass::oid::bigint)))
          ELSE true END
)
SELECT id FROM run WHERE (SELECT count(*) FROM rang) >= 0
