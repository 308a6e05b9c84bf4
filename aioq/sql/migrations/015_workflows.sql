-- Workflows (docs/architecture.md, "Workflows"): steps with dependencies, deferred together in
-- the caller's transaction. A step is a job (its row in jobs, with workflow_id set) plus its
-- bookkeeping here. A step whose dependencies have not all succeeded is `waiting`: not in the
-- claim's partial index (status = 'pending'), so the claim never sees it. The statement that
-- records a step's success (aioq.sql.outcomes.WRITE_STEP_OUTCOMES) decrements its dependents'
-- `remaining` under their step rows' locks and makes those that reach zero pending: each
-- success is recorded once (the fence), so each fan-in happens once. Plain jobs keep
-- workflow_id NULL and pay for none of it but the trigger's WHEN test on a status change.
ALTER TABLE @schema.jobs
    DROP CONSTRAINT jobs_status_check,
    ADD CONSTRAINT jobs_status_check
        CHECK (status IN ('pending', 'running', 'dead', 'cancelled', 'waiting')),
    ADD COLUMN workflow_id bigint;

-- A run's steps, for aioq.workflow() and cancel_workflow(); plain jobs are not in it.
CREATE INDEX jobs_workflow_idx ON @schema.jobs (workflow_id) WHERE workflow_id IS NOT NULL;

CREATE TABLE @schema.workflows (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    steps integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX workflows_created_at_idx ON @schema.workflows (created_at);

-- One row per step, kept while the run lives (its job row leaves jobs when it succeeds).
-- remaining: dependencies still to succeed (on_failure 'run': still to end);
-- blocked_by: the dependency whose failure cancelled this step (a replay of it revives this);
-- succeeded_at and result: written by the statement that recorded its success.
CREATE TABLE @schema.workflow_steps (
    job_id bigint PRIMARY KEY,
    workflow_id bigint NOT NULL,
    name text NOT NULL,
    task text NOT NULL,
    remaining integer NOT NULL,
    on_failure text NOT NULL DEFAULT 'cancel'
        CONSTRAINT workflow_steps_on_failure_check CHECK (on_failure IN ('cancel', 'run')),
    blocked_by bigint,
    succeeded_at timestamptz,
    result jsonb,
    CONSTRAINT workflow_steps_name_key UNIQUE (workflow_id, name)
);

-- The dependency edges: job_id runs after parent_id. By parent for the fan-in, by dependent
-- for upstream().
CREATE TABLE @schema.workflow_deps (
    parent_id bigint NOT NULL,
    job_id bigint NOT NULL,
    PRIMARY KEY (parent_id, job_id)
);

CREATE INDEX workflow_deps_job_idx ON @schema.workflow_deps (job_id);

-- A step ended dead or cancelled, by whatever path (an outcome, the reaper, a cancel, a
-- cancelled run): the waiting steps that need it, directly or through others, are cancelled in
-- one statement (a recursive query over the edges, never a recursion of triggers: the steps it
-- cancels do not fire this again, their WHEN is false), each naming the step that failed and
-- remembering the dependency that blocked it; the steps that run anyway (on_failure 'run')
-- count each of these as ended. A step replayed (dead to pending or waiting) revives the steps
-- it blocked the same way. Every step row it writes is locked first, in one pass in id order,
-- then their job rows: as WRITE_STEP_OUTCOMES does.
CREATE FUNCTION @schema.workflow_step_changed() RETURNS trigger
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
            RETURNING w.job_id, w.remaining
        ),
        released AS (
            UPDATE @schema.jobs AS j SET status = 'pending', run_at = greatest(j.run_at, now())
            WHERE j.id = ANY(ARRAY(SELECT job_id FROM counted WHERE remaining <= 0))
              AND j.status = 'waiting'
            RETURNING j.queue
        )
        SELECT count(pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)) INTO rung
        FROM (SELECT DISTINCT queue FROM released) AS q;
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

-- A replay makes a step pending; one whose dependencies have not all succeeded waits instead.
CREATE FUNCTION @schema.workflow_step_replayed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM @schema.workflow_steps AS w
               WHERE w.job_id = NEW.id AND w.remaining > 0) THEN
        NEW.status := 'waiting';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER jobs_workflow_step_replayed
    BEFORE UPDATE OF status ON @schema.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND NEW.status = 'pending'
          AND OLD.status IN ('dead', 'cancelled'))
    EXECUTE FUNCTION @schema.workflow_step_replayed();

-- Not for the steps the function itself cancels (waiting, now DependencyFailed) or revives
-- (cancelled as DependencyFailed, now waiting): it handled them in the statement that did.
CREATE TRIGGER jobs_workflow_step_changed
    AFTER UPDATE OF status ON @schema.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND (
        (NEW.status IN ('dead', 'cancelled') AND OLD.status NOT IN ('dead', 'cancelled')
         AND NOT (OLD.status = 'waiting' AND NEW.last_error LIKE 'DependencyFailed:%'))
        OR (OLD.status IN ('dead', 'cancelled') AND NEW.status IN ('pending', 'waiting')
            AND NOT (OLD.status = 'cancelled' AND NEW.status = 'waiting'
                     AND OLD.last_error LIKE 'DependencyFailed:%'))))
    EXECUTE FUNCTION @schema.workflow_step_changed();
