-- Workflows, second part. A workflow step's delay counts from the moment it becomes ready
-- (docs/workflows.md): the
-- statement that releases it (its last dependency succeeded, or ended for a step that runs
-- anyway) sets run_at = now() + delay. NULL: no delay, or a run_at given as a time (then it
-- stays, or now if past). A step without dependencies counts from the defer, as before; steps
-- deferred before this migration keep the run_at of their defer. The function below is
-- migration 15's with that release, and its doorbell rung as aioq's statements ring it.
ALTER TABLE @schema.workflow_steps ADD COLUMN delay interval;

-- The workflows list (aioq.sql.workflows.LIST_WORKFLOWS) reads each run's succeeded steps from
-- its row, kept by the statement that records their successes (one row update per run and
-- batch of outcomes, after every other lock of that statement), and counts the steps still in
-- jobs per status up to a bound (workflow_counts below): a run of 100 000 steps costs the page
-- at most bound + 1 index entries per status, never the whole run. Runs deferred before this
-- migration have their count filled in here. The jobs index replaces migration 15's
-- (workflow_id), which served the same lookups by run; plain jobs stay out of it.
ALTER TABLE @schema.workflows ADD COLUMN succeeded integer NOT NULL DEFAULT 0;
UPDATE @schema.workflows AS w
SET succeeded = (SELECT count(*) FROM @schema.workflow_steps AS s
                 WHERE s.workflow_id = w.id AND s.succeeded_at IS NOT NULL);
DROP INDEX @schema.jobs_workflow_idx;
CREATE INDEX jobs_workflow_idx ON @schema.jobs (workflow_id, status, id)
    WHERE workflow_id IS NOT NULL;

-- A run's steps still in jobs per status, each counted up to bound + 1 along its index range,
-- in order. The function's planner settings make each count an index scan whatever the
-- statistics say: a run inserted since the last ANALYZE looks small, and the plan chosen for a
-- small range (a bitmap scan, which reads the whole range before the LIMIT, or a sequential
-- scan) would read every step of a run of 100 000.
CREATE FUNCTION @schema.workflow_counts(
    run bigint, bound integer,
    OUT waiting integer, OUT pending integer, OUT running integer, OUT dead integer,
    OUT cancelled integer)
LANGUAGE sql STABLE
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
SELECT
    (SELECT count(*) FROM (
        SELECT FROM @schema.jobs AS j WHERE j.workflow_id = run AND j.status = 'waiting'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM @schema.jobs AS j WHERE j.workflow_id = run AND j.status = 'pending'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM @schema.jobs AS j WHERE j.workflow_id = run AND j.status = 'running'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM @schema.jobs AS j WHERE j.workflow_id = run AND j.status = 'dead'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM @schema.jobs AS j WHERE j.workflow_id = run AND j.status = 'cancelled'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer
$$;

CREATE OR REPLACE FUNCTION @schema.workflow_step_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    reason text;
    step_name text;
    rung integer;
    chain bigint[];
    runners bigint[];
BEGIN
    -- Rows are found by `= ANY(...)` in the primary keys: a run's rows are often all inserted
    -- since the last ANALYZE, and a join would scan them.
    IF NOT EXISTS (SELECT FROM @schema.workflow_deps AS d WHERE d.parent_id = NEW.id) THEN
        RETURN NULL;
    END IF;
    IF NEW.status IN ('dead', 'cancelled') THEN
        -- The waiting steps that need it (cancel mode), directly or through others.
        WITH RECURSIVE doomed(job_id) AS (
            SELECT NEW.id
            UNION
            SELECT w.job_id
            FROM doomed AS x
            CROSS JOIN LATERAL (
                SELECT ARRAY(SELECT d.job_id FROM @schema.workflow_deps AS d
                             WHERE d.parent_id = x.job_id) AS ids
            ) AS c
            JOIN @schema.workflow_steps AS w ON w.job_id = ANY(c.ids)
            JOIN @schema.jobs AS j ON j.id = ANY(c.ids) AND j.id = w.job_id
            WHERE w.on_failure = 'cancel' AND j.status = 'waiting'
        )
        SELECT array_agg(job_id) INTO chain FROM doomed;
        -- The steps that run anyway, after any of them.
        runners := ARRAY(
            SELECT DISTINCT w.job_id
            FROM @schema.workflow_steps AS w
            WHERE w.job_id = ANY(ARRAY(SELECT d.job_id FROM @schema.workflow_deps AS d
                                       WHERE d.parent_id = ANY(chain)))
              AND w.on_failure = 'run');
        PERFORM 1 FROM @schema.workflow_steps AS w
        WHERE w.job_id = ANY(array_remove(chain, NEW.id) || runners)
        ORDER BY w.job_id FOR UPDATE;
        SELECT name INTO step_name FROM @schema.workflow_steps WHERE job_id = NEW.id;
        reason := format('DependencyFailed: step %L (job %s) ended %s', step_name, NEW.id,
                         NEW.status);
        WITH blocked AS (
            UPDATE @schema.workflow_steps AS w
            SET blocked_by = (SELECT min(d.parent_id) FROM @schema.workflow_deps AS d
                              WHERE d.job_id = w.job_id AND d.parent_id = ANY(chain))
            WHERE w.job_id = ANY(array_remove(chain, NEW.id))
            RETURNING w.job_id
        )
        UPDATE @schema.jobs AS j
        SET status = 'cancelled', last_error = reason, run_at = now()
        WHERE j.id = ANY(ARRAY(SELECT job_id FROM blocked)) AND j.status = 'waiting';
        -- One dependency fewer to wait for, per edge from the failed steps.
        WITH edges AS (
            SELECT d.job_id, count(*)::integer AS n
            FROM @schema.workflow_deps AS d
            WHERE d.parent_id = ANY(chain) AND d.job_id = ANY(runners)
            GROUP BY d.job_id
        ),
        counted AS (
            UPDATE @schema.workflow_steps AS w SET remaining = w.remaining - e.n
            FROM edges AS e
            WHERE w.job_id = ANY(ARRAY(
                SELECT j.id FROM @schema.jobs AS j
                WHERE j.id = ANY(runners) AND j.status = 'waiting'))
              AND w.job_id = e.job_id
            RETURNING w.job_id, w.remaining, w.delay
        ),
        released AS (
            UPDATE @schema.jobs AS j SET status = 'pending',
                run_at = CASE WHEN c.delay IS NULL THEN greatest(j.run_at, now())
                              ELSE now() + c.delay END
            FROM counted AS c
            WHERE j.id = ANY(ARRAY(SELECT job_id FROM counted WHERE remaining <= 0))
              AND j.id = c.job_id AND j.status = 'waiting'
            RETURNING j.queue, j.run_at
        )
        -- The doorbell as aioq.sql.doorbell.ring() rings it: for the queues of steps claimable
        -- now, when a worker is on duty for them (else holding the duty key shared: an
        -- insert in flight).
        SELECT count(pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)) INTO rung
        FROM (SELECT DISTINCT queue FROM released WHERE run_at <= now() OFFSET 0) AS q
        WHERE NOT pg_try_advisory_xact_lock_shared(TG_RELID::int, hashtext(q.queue));
    ELSE
        -- Replayed: the steps it blocked, directly or through others, wait again.
        WITH RECURSIVE revived(job_id) AS (
            SELECT NEW.id
            UNION
            SELECT w.job_id
            FROM revived AS x
            CROSS JOIN LATERAL (
                SELECT ARRAY(SELECT d.job_id FROM @schema.workflow_deps AS d
                             WHERE d.parent_id = x.job_id) AS ids
            ) AS c
            JOIN @schema.workflow_steps AS w ON w.job_id = ANY(c.ids)
            WHERE w.blocked_by = x.job_id
        )
        SELECT array_agg(job_id) INTO chain FROM revived;
        runners := ARRAY(
            SELECT DISTINCT w.job_id
            FROM @schema.workflow_steps AS w
            WHERE w.job_id = ANY(ARRAY(SELECT d.job_id FROM @schema.workflow_deps AS d
                                       WHERE d.parent_id = ANY(chain)))
              AND w.on_failure = 'run');
        PERFORM 1 FROM @schema.workflow_steps AS w
        WHERE w.job_id = ANY(array_remove(chain, NEW.id) || runners)
        ORDER BY w.job_id FOR UPDATE;
        WITH unblocked AS (
            UPDATE @schema.workflow_steps AS w SET blocked_by = NULL
            WHERE w.job_id = ANY(array_remove(chain, NEW.id))
            RETURNING w.job_id
        )
        UPDATE @schema.jobs AS j
        SET status = 'waiting', last_error = NULL, cancel_requested_at = NULL, run_at = now()
        WHERE j.id = ANY(ARRAY(SELECT job_id FROM unblocked)) AND j.status = 'cancelled';
        -- The steps that run anyway wait for them again, per edge.
        WITH edges AS (
            SELECT d.job_id, count(*)::integer AS n
            FROM @schema.workflow_deps AS d
            WHERE d.parent_id = ANY(chain) AND d.job_id = ANY(runners)
            GROUP BY d.job_id
        )
        UPDATE @schema.workflow_steps AS w SET remaining = w.remaining + e.n
        FROM edges AS e
        WHERE w.job_id = ANY(ARRAY(
            SELECT j.id FROM @schema.jobs AS j
            WHERE j.id = ANY(runners) AND j.status = 'waiting'))
          AND w.job_id = e.job_id;
    END IF;
    RETURN NULL;
END;
$$;
