-- The doorbell's keys become 64 bits, and the wildcard comes (docs/architecture.md, "The
-- doorbell"). A queue's duty key was (the jobs table's oid, hashtext(queue)): two queue names
-- with the same 32-bit hashtext shared it, and a worker that slept on the other's watch was
-- never handed over to. It is now hashtextextended(queue, oid), its standby key
-- hashtextextended(queue, ~oid), in the 64-bit form of the advisory lock functions; a worker
-- leaving duty rings the key (on the hand-over channel), so even two names that shared one
-- would only ring each other's workers for nothing (doorbell_key below computes a name's key).
-- The key of the empty name, which no queue has, is the wildcard's: a worker that serves more
-- queues than it arms one by one goes on duty for "any queue", and an insert that finds no worker on duty for its queue tries the
-- wildcard's key shared and releases it at once (never holding it), ringing when a worker holds
-- it. aioq's own statements ring in Python-side SQL; the workflow trigger's release of the
-- steps a success makes ready rings here as they do (the function below is migration 17's with
-- that ring), and so does the opt-in trigger for raw-SQL inserts when it is installed
-- (aioq/sql/ring_trigger.sql): a schema without it is left without it.
-- A name's duty key, as the advisory lock functions' 64-bit form takes it: the queue's, or
-- for the empty name the wildcard's. pg_locks shows a key as classid (its high 32 bits) and
-- objid (its low 32 bits), objsubid 1 (docs/operations-and-cli.md). The triggers below ring
-- with it; aioq's own statements compute the same expression in place.
CREATE FUNCTION @schema.doorbell_key(queue text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT hashtextextended(queue, '@schema.jobs'::regclass::oid::bigint) $$;

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
        -- The doorbell as aioq's statements ring it (aioq.sql.fragments.RINGS): for the
        -- queues of steps claimable now, when a worker is on duty for them or for any queue
        -- (else holding the queue's duty key shared: an insert in flight).
        SELECT count(pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)) INTO rung
        FROM (SELECT DISTINCT queue FROM released WHERE run_at <= now() OFFSET 0) AS q
        WHERE CASE WHEN pg_try_advisory_xact_lock_shared(@schema.doorbell_key(q.queue))
                   THEN NOT (pg_try_advisory_lock_shared(@schema.doorbell_key(''))
                             AND pg_advisory_unlock_shared(@schema.doorbell_key('')))
                   ELSE true END;
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

-- The opt-in doorbell trigger's function, where it is installed (`aioq schema apply
-- --ring-trigger`): as aioq/sql/ring_trigger.sql now writes it.
DO $do$
BEGIN
    IF to_regprocedure('@schema.ring_doorbell()') IS NOT NULL THEN
        CREATE OR REPLACE FUNCTION @schema.ring_doorbell() RETURNS trigger
        LANGUAGE plpgsql AS $fn$
        BEGIN
            PERFORM pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)
            FROM (SELECT DISTINCT queue FROM new_jobs
                  WHERE run_at <= now() AND status = 'pending' OFFSET 0) AS q
            WHERE CASE WHEN pg_try_advisory_xact_lock_shared(@schema.doorbell_key(q.queue))
                       THEN NOT (pg_try_advisory_lock_shared(@schema.doorbell_key(''))
                                 AND pg_advisory_unlock_shared(@schema.doorbell_key('')))
                       ELSE true END;
            RETURN NULL;
        END;
        $fn$;
    END IF;
END;
$do$;
