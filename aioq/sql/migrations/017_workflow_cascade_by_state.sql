-- Workflows, third part: the workflow trigger tells its own cascade apart by state, never by the
-- text of last_error (docs/architecture.md, "Workflows"). Until now it recognised the steps it
-- cancelled, and those it revived, by a last_error starting with 'DependencyFailed:'; a cancel
-- with such a reason (aioq.admin.cancel_jobs(..., reason=...)) passed for the trigger's own, and
-- the cancelled step's dependents waited for ever. A step cancelled because a dependency failed
-- now records which one on its job row, `blocked_by` (it was on the step row, where the
-- trigger's WHEN cannot read it): the trigger skips exactly the rows whose blocked_by it sets
-- (waiting -> cancelled) or clears (cancelled -> waiting), and a replay revives the steps whose
-- blocked_by names the replayed step. Steps cancelled so before this migration keep it.
ALTER TABLE @schema.jobs ADD COLUMN blocked_by bigint;
UPDATE @schema.jobs AS j SET blocked_by = s.blocked_by
FROM @schema.workflow_steps AS s
WHERE s.job_id = j.id AND s.blocked_by IS NOT NULL AND j.status = 'cancelled';
ALTER TABLE @schema.workflow_steps DROP COLUMN blocked_by;

-- Migration 16's function with blocked_by on the job row: the cascade sets it with the cancel,
-- the revival clears it with the wait, each in the one UPDATE of the job rows (step rows still
-- locked first, in id order).
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
        -- Each remembers the dependency that blocked it (in the chain): a replay of that one
        -- revives it.
        UPDATE @schema.jobs AS j
        SET status = 'cancelled', last_error = reason, run_at = now(),
            blocked_by = (SELECT min(d.parent_id) FROM @schema.workflow_deps AS d
                          WHERE d.job_id = j.id AND d.parent_id = ANY(chain))
        WHERE j.id = ANY(array_remove(chain, NEW.id)) AND j.status = 'waiting';
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
            SELECT j.id
            FROM revived AS x
            CROSS JOIN LATERAL (
                SELECT ARRAY(SELECT d.job_id FROM @schema.workflow_deps AS d
                             WHERE d.parent_id = x.job_id) AS ids
            ) AS c
            JOIN @schema.jobs AS j ON j.id = ANY(c.ids)
            WHERE j.blocked_by = x.job_id
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
        UPDATE @schema.jobs AS j
        SET status = 'waiting', blocked_by = NULL, last_error = NULL, cancel_requested_at = NULL,
            run_at = now()
        WHERE j.id = ANY(array_remove(chain, NEW.id)) AND j.status = 'cancelled'
          AND j.blocked_by IS NOT NULL;
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

-- Not for the steps the function itself cancels (waiting to cancelled, blocked_by set) or
-- revives (cancelled with blocked_by set, to waiting): it handled them in the statement that
-- did. A step cancelled by a cancel (blocked_by NULL), whatever its reason says, cascades.
DROP TRIGGER jobs_workflow_step_changed ON @schema.jobs;
CREATE TRIGGER jobs_workflow_step_changed
    AFTER UPDATE OF status ON @schema.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND (
        (NEW.status IN ('dead', 'cancelled') AND OLD.status NOT IN ('dead', 'cancelled')
         AND NEW.blocked_by IS NULL)
        OR (OLD.status IN ('dead', 'cancelled') AND NEW.status IN ('pending', 'waiting')
            AND OLD.blocked_by IS NULL)))
    EXECUTE FUNCTION @schema.workflow_step_changed();
