-- aioq schema: the only copy of the DDL.
--
-- Applied by `aioq schema apply` or `await aioq.install(conn)`. {{schema}} is replaced by
-- the quoted schema name. The part before the first migration marker runs every time and must
-- be idempotent; each `-- aioq:migration N` block runs once, in order, inside one transaction
-- holding an advisory lock, and is recorded in {{schema}}.migrations.

CREATE SCHEMA IF NOT EXISTS {{schema}};

CREATE TABLE IF NOT EXISTS {{schema}}.migrations (
    version integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- aioq:ring-trigger begin
-- The opt-in doorbell trigger for jobs inserted with raw SQL (docs/architecture.md, "The
-- doorbell"): not part of the schema unless asked for (`aioq schema apply --ring-trigger`,
-- `aioq.install(conn, ring_trigger=True)`). aioq's own statements ring without it. It rings a
-- queue as they do: when the shared try of the queue's duty key fails (a worker is on duty),
-- else holding that key until the transaction ends (an insert in flight). Only jobs that are
-- claimable now ring: not a delayed job, nor a workflow step waiting for its dependencies.
CREATE OR REPLACE FUNCTION {{schema}}.ring_doorbell() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE run_at <= now() AND status = 'pending') AS q
    WHERE NOT pg_try_advisory_xact_lock_shared(TG_RELID::int, hashtext(q.queue));
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS jobs_doorbell ON {{schema}}.jobs;
CREATE TRIGGER jobs_doorbell
    AFTER INSERT ON {{schema}}.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.ring_doorbell();
-- aioq:ring-trigger end

-- aioq:migration 1

CREATE TABLE {{schema}}.jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL DEFAULT 'default',
    task text NOT NULL,
    args jsonb NOT NULL DEFAULT '{}',
    status text NOT NULL DEFAULT 'pending'
        CONSTRAINT jobs_status_check CHECK (status IN ('pending', 'running', 'dead')),
    priority integer NOT NULL DEFAULT 0,
    run_at timestamptz NOT NULL DEFAULT now(),
    attempts integer NOT NULL DEFAULT 0,
    max_attempts integer NOT NULL DEFAULT 5 CONSTRAINT jobs_max_attempts_check CHECK (max_attempts >= 1),
    lease interval NOT NULL DEFAULT interval '30 seconds'
        CONSTRAINT jobs_lease_check CHECK (lease > interval '0'),
    locked_by text,
    locked_at timestamptz,
    lease_expires_at timestamptz,
    last_error text,
    unique_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- A running job always has an owner and a lease: the fence needs both.
    CONSTRAINT jobs_running_locked CHECK (
        status <> 'running' OR (locked_by IS NOT NULL AND lease_expires_at IS NOT NULL)
    )
) WITH (
    -- The table is a queue: rows are inserted, updated a few times and deleted.
    -- Vacuum it early and without throttling so dead tuples never pile up.
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- Matches the claim exactly: WHERE status = 'pending' AND queue = $1 AND run_at <= now()
-- ORDER BY priority DESC, run_at, id. Dead rows are not in it, so history costs the claim nothing.
CREATE INDEX jobs_claim_idx ON {{schema}}.jobs (queue, priority DESC, run_at, id)
    WHERE status = 'pending';

-- The reaper's scan: only running rows, so it stays the size of the in-flight set.
CREATE INDEX jobs_lease_idx ON {{schema}}.jobs (lease_expires_at) WHERE status = 'running';

-- At most one live job per unique_key.
CREATE UNIQUE INDEX jobs_unique_key_idx ON {{schema}}.jobs (unique_key)
    WHERE unique_key IS NOT NULL AND status IN ('pending', 'running');

-- Inspection and replay of dead jobs by task or queue.
CREATE INDEX jobs_dead_idx ON {{schema}}.jobs (task, queue) WHERE status = 'dead';

-- Completed jobs, kept only when a worker runs with keep_completed=True; pruned in batches.
CREATE TABLE {{schema}}.archive (
    id bigint PRIMARY KEY,
    queue text NOT NULL,
    task text NOT NULL,
    args jsonb NOT NULL,
    priority integer NOT NULL,
    attempts integer NOT NULL,
    max_attempts integer NOT NULL,
    worker text,
    created_at timestamptz NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX archive_finished_at_idx ON {{schema}}.archive (finished_at);

-- The doorbell: one NOTIFY per queue per statement (and PostgreSQL folds duplicates within a
-- transaction), sent only at commit, carrying the queue name and no job data.
CREATE FUNCTION {{schema}}.ring_doorbell() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE run_at <= now()) AS q;
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_doorbell
    AFTER INSERT ON {{schema}}.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.ring_doorbell();

-- aioq:migration 2

-- Claim identity. `claims` counts the claims of a job and never decreases (a snooze, a release
-- or a replay leaves it alone, where `attempts` is refunded or reset), so (id, claims) names
-- one claim among all of a job's claims: every write after the claim is fenced on it, and a
-- stale write (a lost lease, a retried write whose reply was lost) matches no later claim.
-- `snoozes` counts the runs that ended in aioq.Retry; each also added one to max_attempts.
ALTER TABLE {{schema}}.jobs
    ADD COLUMN claims integer NOT NULL DEFAULT 0,
    ADD COLUMN snoozes integer NOT NULL DEFAULT 0;

-- aioq:migration 3

-- The W3C traceparent of the span that deferred the job (aioq.contrib.otel), NULL when no
-- tracer was recording: the worker's span for the run continues that trace.
ALTER TABLE {{schema}}.jobs ADD COLUMN traceparent text;

-- aioq:migration 4
-- Periodic jobs. One row per schedule: the latest tick enqueued. A tick's job is inserted in
-- the same statement that advances last_tick, conditioned on last_tick being older, so each
-- tick is enqueued once whatever the number of workers, even after its job left the table.

CREATE TABLE {{schema}}.schedules (
    name text PRIMARY KEY,
    task text NOT NULL,
    queue text NOT NULL,
    spec text NOT NULL,               -- "every 60s" or "cron */5 * * * * Europe/Paris"
    last_tick timestamptz NOT NULL,   -- the latest tick enqueued (or skipped at first sight)
    next_tick timestamptz,            -- the tick after it, as the last writer computed it
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The tick a periodic job was enqueued for (NULL for other jobs); the task reads it from
-- aioq.current_job().scheduled_at.
ALTER TABLE {{schema}}.jobs ADD COLUMN scheduled_at timestamptz;

-- aioq:migration 5
-- Queue limits and pauses, read by every worker, so the whole fleet obeys them. A queue with
-- no row here (or with no limit set and not paused) is claimed by the plain claim statement and
-- pays nothing for this; a limited queue's claims lock its row, so they take turns, and count
-- what they may take in a fresh snapshot under that lock.

CREATE TABLE {{schema}}.queues (
    name text PRIMARY KEY,
    max_running integer CONSTRAINT queues_max_running_check CHECK (max_running >= 1),
    rate_limit integer CONSTRAINT queues_rate_limit_check CHECK (rate_limit >= 1),
    rate_period interval CONSTRAINT queues_rate_period_check CHECK (rate_period > interval '0'),
    paused boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT queues_rate_pair CHECK ((rate_limit IS NULL) = (rate_period IS NULL))
);

-- Claims of rate-limited queues, counted per slot of a tenth of the period. A claim counts
-- every slot that overlaps the last period, so the count never falls short of the claims
-- really made in any window of that length (it may exceed them by up to one slot).
CREATE TABLE {{schema}}.queue_claims (
    queue text NOT NULL,
    slot_start timestamptz NOT NULL,
    slot_end timestamptz NOT NULL,
    claims integer NOT NULL,
    PRIMARY KEY (queue, slot_start)
);

-- aioq:migration 6
-- Job control: cancelled as a kept terminal state, cancel requests for running jobs,
-- progress, and stored results of tasks with a result_ttl.

ALTER TABLE {{schema}}.jobs
    DROP CONSTRAINT jobs_status_check,
    ADD CONSTRAINT jobs_status_check
        CHECK (status IN ('pending', 'running', 'dead', 'cancelled')),
    -- Set by cancel_jobs on a running job; its worker cancels the run and records `cancelled`.
    -- A job that leaves `running` any other way while it is set never runs again.
    ADD COLUMN cancel_requested_at timestamptz,
    ADD COLUMN progress double precision
        CONSTRAINT jobs_progress_check CHECK (progress BETWEEN 0 AND 1),
    ADD COLUMN progress_note text,
    -- Every path out of `running` turns a requested cancel into `cancelled`; this makes one
    -- that forgets fail loudly instead of running a cancelled job again.
    ADD CONSTRAINT jobs_pending_not_cancelled
        CHECK (status <> 'pending' OR cancel_requested_at IS NULL);

-- Return values of tasks with a result_ttl, kept until expires_at; the pruner deletes expired
-- rows in bounded batches. A row here means the job succeeded; it left the jobs table in the
-- same statement that wrote this row.
CREATE TABLE {{schema}}.results (
    id bigint PRIMARY KEY,
    queue text NOT NULL,
    task text NOT NULL,
    args jsonb NOT NULL,
    priority integer NOT NULL,
    attempts integer NOT NULL,
    max_attempts integer NOT NULL,
    worker text,
    progress double precision,
    progress_note text,
    created_at timestamptz NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    result jsonb NOT NULL
);

CREATE INDEX results_expires_at_idx ON {{schema}}.results (expires_at);

-- aioq:migration 7



-- The doorbell rings only for a queue some worker sleeps on (docs/architecture.md, "The doorbell"): PostgreSQL
-- takes one lock for the whole notification queue at the commit of every transaction that
-- called NOTIFY, so a NOTIFY per insert serializes the commits of every deferring connection.
-- A worker about to sleep holds a shared session advisory lock (the jobs table's oid,
-- hashtext(queue)) on its LISTEN connection, and releases it when rung. A statement rings a
-- queue only when an exclusive try of that lock fails (taken, it is released at once): two
-- lock-table calls per queue and statement, about what the NOTIFY cost. The lock goes with the
-- session, so a killed worker stops the ringing. Polling stays the guarantee.
CREATE OR REPLACE FUNCTION {{schema}}.ring_doorbell() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE run_at <= now()) AS q
    WHERE NOT (
        pg_try_advisory_lock(TG_RELID::int, hashtext(q.queue))
        AND pg_advisory_unlock(TG_RELID::int, hashtext(q.queue))
    );
    RETURN NULL;
END;
$$;

-- aioq:migration 8

-- Workers record themselves here (the stats writer upserts its row every minute and deletes it
-- on a clean stop), so the dashboard can list them without asking the workers anything.
CREATE TABLE {{schema}}.workers (
    id text PRIMARY KEY,
    host text NOT NULL,
    pid integer NOT NULL,
    queues text[] NOT NULL,
    concurrency integer NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    last_seen timestamptz NOT NULL DEFAULT now()
);

-- Per-minute outcome counts, one row per worker, minute, queue and task, written by each
-- worker in one statement a minute and pruned after a retention period. Completed jobs are
-- deleted, so this is the only history of throughput. The *_hist arrays count attempts per
-- bucket of aioq.stats_history.BUCKETS (seconds); summed across rows they give percentiles.
CREATE TABLE {{schema}}.stats_history (
    minute timestamptz NOT NULL,
    worker text NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    completed integer NOT NULL DEFAULT 0,
    retried integer NOT NULL DEFAULT 0,
    dead integer NOT NULL DEFAULT 0,
    wait_hist integer[] NOT NULL,
    run_hist integer[] NOT NULL,
    PRIMARY KEY (minute, worker, queue, task)
);

-- The dashboard lists dead jobs newest first by keyset (id < cursor): without an index ordered
-- by id among dead rows alone, that page would walk the primary key past every live job.
-- Dead rows are off the hot path, so this costs the claim and the completion nothing.
CREATE INDEX jobs_dead_id_idx ON {{schema}}.jobs (id) WHERE status = 'dead';

-- The same for cancelled jobs (kept like dead ones until pruned), and what lets the overview
-- count them per queue without reading the table.
CREATE INDEX jobs_cancelled_id_idx ON {{schema}}.jobs (id) WHERE status = 'cancelled';

-- aioq:migration 9

-- The worker that held a job's latest ended claim (retried, dead, cancelled, released or
-- rescued): every statement that ends a claim without deleting the row clears locked_by, so
-- a dead job would otherwise not say where it ran last. Written in the same UPDATE, from the
-- old locked_by; NULL until a claim ends. No default: adding it rewrites nothing.
ALTER TABLE {{schema}}.jobs ADD COLUMN last_worker text;

-- The throughput page's day view summed stats_history over every minute and worker of the day
-- (288,000 rows for 200 workers x queues x tasks: half a second). This is the same history
-- summed over workers per half hour (aioq.queries.ROLLUP_STEP, the day view's step), kept by
-- the same per-minute statement of each worker and pruned with it: the day view reads about
-- 50 rows per queue and task. `minute` is the first minute of the half hour.
CREATE TABLE {{schema}}.stats_rollup (
    minute timestamptz NOT NULL,
    queue text NOT NULL,
    task text NOT NULL,
    completed integer NOT NULL DEFAULT 0,
    retried integer NOT NULL DEFAULT 0,
    dead integer NOT NULL DEFAULT 0,
    wait_hist integer[] NOT NULL,
    run_hist integer[] NOT NULL,
    PRIMARY KEY (minute, queue, task)
);

-- The history recorded so far, so the day view has no gap after the upgrade.
INSERT INTO {{schema}}.stats_rollup
    (minute, queue, task, completed, retried, dead, wait_hist, run_hist)
SELECT c.minute, c.queue, c.task, c.completed, c.retried, c.dead, h.wait_hist, h.run_hist
FROM (
    SELECT date_bin('30 minutes', minute, timestamptz '2000-01-01') AS minute, queue, task,
           sum(completed)::integer AS completed, sum(retried)::integer AS retried,
           sum(dead)::integer AS dead
    FROM {{schema}}.stats_history
    GROUP BY 1, 2, 3
) AS c
JOIN (
    SELECT minute, queue, task, array_agg(w ORDER BY i)::integer[] AS wait_hist,
           array_agg(r ORDER BY i)::integer[] AS run_hist
    FROM (
        SELECT date_bin('30 minutes', s.minute, timestamptz '2000-01-01') AS minute, s.queue,
               s.task, u.i, sum(u.w) AS w, sum(u.r) AS r
        FROM {{schema}}.stats_history AS s,
             unnest(s.wait_hist, s.run_hist) WITH ORDINALITY AS u(w, r, i)
        GROUP BY 1, 2, 3, 4
    ) AS per_bucket
    GROUP BY 1, 2, 3
) AS h USING (minute, queue, task);

-- aioq:migration 10

-- Job arguments (jsonb, often kilobytes) are TOASTed and compressed past about 2 KB; lz4
-- compresses a 64 KB argument in a third of pglz's time and decompresses it several times
-- faster, for the claim. A server built without lz4 (or older than PostgreSQL 14) keeps pglz.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE {{schema}}.jobs ALTER COLUMN args SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR syntax_error THEN
    NULL;
END
$$;

-- aioq:migration 11

-- The doorbell without a lost wake-up (docs/architecture.md, "The doorbell"). Migration 7 left one: a
-- transaction that inserted while nobody slept (so it did not ring) and committed after a
-- worker armed and looked once more (its row not yet visible) waited for the next poll. Now a
-- statement that could ring also holds, until its transaction ends, a shared transaction-level
-- advisory lock (~the jobs table's oid, hashtext(queue)): "an insert is in flight". A worker
-- arming tries that key exclusively after taking its doorbell lock; when it fails, an insert
-- that may not have rung is uncommitted, and the worker looks again shortly instead of
-- sleeping (aioq.producer.Producer.wait). Inserters share the key, so they never wait on each
-- other; a failed try means a worker is testing the key right now, with its doorbell lock
-- already held, so the statement rings. One more lock-table call per queue and statement, and
-- its release at commit.
CREATE OR REPLACE FUNCTION {{schema}}.ring_doorbell() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE run_at <= now()) AS q
    WHERE NOT (
        pg_try_advisory_xact_lock_shared(~TG_RELID::int, hashtext(q.queue))
        AND pg_try_advisory_lock(TG_RELID::int, hashtext(q.queue))
        AND pg_advisory_unlock(TG_RELID::int, hashtext(q.queue))
    );
    RETURN NULL;
END;
$$;

-- aioq:migration 12

-- Per-key concurrency (docs/architecture.md, "Per-key concurrency"): a job may carry a key (a
-- tenant, an account), and a queue may cap the jobs of one key running at once across the
-- fleet. Both indexes hold keyed jobs only, so jobs without a key cost them nothing; the claim
-- of a queue without max_running_per_key never reads them.
ALTER TABLE {{schema}}.jobs ADD COLUMN concurrency_key text;
ALTER TABLE {{schema}}.queues ADD COLUMN max_running_per_key integer
    CONSTRAINT queues_max_running_per_key_check CHECK (max_running_per_key >= 1);

-- The keyed claim: a skip scan over the distinct keys of a queue's pending jobs, then per key
-- the first jobs in claim order (the same ORDER BY as jobs_claim_idx).
CREATE INDEX jobs_key_claim_idx ON {{schema}}.jobs (queue, concurrency_key, priority DESC, run_at, id)
    WHERE status = 'pending' AND concurrency_key IS NOT NULL;

-- Running jobs per key: each key's count reads at most its own running jobs (at most
-- max_running_per_key of them), never the whole running set.
CREATE INDEX jobs_key_running_idx ON {{schema}}.jobs (queue, concurrency_key)
    WHERE status = 'running' AND concurrency_key IS NOT NULL;

-- Unique jobs over a window (docs/architecture.md, "Unique jobs"): a defer with unique_for
-- records here which job holds its key until when, in the statement that inserts the job; a
-- defer of the key before expires_at returns that job's id, even once the job has left the
-- jobs table. The primary key serializes concurrent defers of one key. Expired rows are
-- pruned in batches; a defer after the expiry takes the row over.
CREATE TABLE {{schema}}.uniques (
    key text PRIMARY KEY,
    job_id bigint NOT NULL,
    expires_at timestamptz NOT NULL
);

CREATE INDEX uniques_expires_at_idx ON {{schema}}.uniques (expires_at);

-- aioq:migration 13

-- Whether a schedule's last_tick was enqueued: at first sight a worker records the latest past
-- tick as done without enqueuing it, and `aioq schedules` shows such a schedule's last tick as
-- never. Rows from before this column may have ticked: they keep showing their last tick.
ALTER TABLE {{schema}}.schedules ADD COLUMN ticked boolean NOT NULL DEFAULT true;
ALTER TABLE {{schema}}.schedules ALTER COLUMN ticked SET DEFAULT false;

-- aioq:migration 14

-- The doorbell off the insert's hot path (docs/architecture.md, "The doorbell"): aioq's own
-- statements ring (a `rang` CTE in every statement that makes a job claimable), so the insert
-- trigger goes; its statement trigger, transition table and query cost about a quarter of an
-- insert's server CPU. The lock protocol changes with it: a worker on duty for a queue holds
-- the queue's key (the jobs table's oid, hashtext(queue)) exclusively, and a statement tries
-- it shared for its transaction (never waiting on, nor ringing, another inserter). Rows that
-- other programs insert with raw SQL ring through aioq.ring(), or the opt-in trigger above
-- (`aioq schema apply --ring-trigger`); without either, polling finds them.
DROP TRIGGER IF EXISTS jobs_doorbell ON {{schema}}.jobs;
DROP FUNCTION IF EXISTS {{schema}}.ring_doorbell();

-- aioq:migration 15

-- Workflows (docs/architecture.md, "Workflows"): steps with dependencies, deferred together in
-- the caller's transaction. A step is a job (its row in jobs, with workflow_id set) plus its
-- bookkeeping here. A step whose dependencies have not all succeeded is `waiting`: not in the
-- claim's partial index (status = 'pending'), so the claim never sees it. The statement that
-- records a step's success (aioq.sql.outcomes.WRITE_STEP_OUTCOMES) decrements its dependents'
-- `remaining` under their step rows' locks and makes those that reach zero pending: each
-- success is recorded once (the fence), so each fan-in happens once. Plain jobs keep
-- workflow_id NULL and pay for none of it but the trigger's WHEN test on a status change.
ALTER TABLE {{schema}}.jobs
    DROP CONSTRAINT jobs_status_check,
    ADD CONSTRAINT jobs_status_check
        CHECK (status IN ('pending', 'running', 'dead', 'cancelled', 'waiting')),
    ADD COLUMN workflow_id bigint;

-- A run's steps, for aioq.workflow() and cancel_workflow(); plain jobs are not in it.
CREATE INDEX jobs_workflow_idx ON {{schema}}.jobs (workflow_id) WHERE workflow_id IS NOT NULL;

CREATE TABLE {{schema}}.workflows (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    steps integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX workflows_created_at_idx ON {{schema}}.workflows (created_at);

-- One row per step, kept while the run lives (its job row leaves jobs when it succeeds).
-- remaining: dependencies still to succeed (on_failure 'run': still to end);
-- blocked_by: the dependency whose failure cancelled this step (a replay of it revives this);
-- succeeded_at and result: written by the statement that recorded its success.
CREATE TABLE {{schema}}.workflow_steps (
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
CREATE TABLE {{schema}}.workflow_deps (
    parent_id bigint NOT NULL,
    job_id bigint NOT NULL,
    PRIMARY KEY (parent_id, job_id)
);

CREATE INDEX workflow_deps_job_idx ON {{schema}}.workflow_deps (job_id);

-- A step ended dead or cancelled, by whatever path (an outcome, the reaper, a cancel, a
-- cancelled run): the waiting steps that need it, directly or through others, are cancelled in
-- one statement (a recursive query over the edges, never a recursion of triggers: the steps it
-- cancels do not fire this again, their WHEN is false), each naming the step that failed and
-- remembering the dependency that blocked it; the steps that run anyway (on_failure 'run')
-- count each of these as ended. A step replayed (dead to pending or waiting) revives the steps
-- it blocked the same way. Every step row it writes is locked first, in one pass in id order,
-- then their job rows: as WRITE_STEP_OUTCOMES does.
CREATE FUNCTION {{schema}}.workflow_step_changed() RETURNS trigger
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
    IF NOT EXISTS (SELECT FROM {{schema}}.workflow_deps AS d WHERE d.parent_id = NEW.id) THEN
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
                SELECT ARRAY(SELECT d.job_id FROM {{schema}}.workflow_deps AS d
                             WHERE d.parent_id = x.job_id) AS ids
            ) AS c
            JOIN {{schema}}.workflow_steps AS w ON w.job_id = ANY(c.ids)
            JOIN {{schema}}.jobs AS j ON j.id = ANY(c.ids) AND j.id = w.job_id
            WHERE w.on_failure = 'cancel' AND j.status = 'waiting'
        )
        SELECT array_agg(job_id) INTO chain FROM doomed;
        -- The steps that run anyway, after any of them.
        runners := ARRAY(
            SELECT DISTINCT w.job_id
            FROM {{schema}}.workflow_steps AS w
            WHERE w.job_id = ANY(ARRAY(SELECT d.job_id FROM {{schema}}.workflow_deps AS d
                                       WHERE d.parent_id = ANY(chain)))
              AND w.on_failure = 'run');
        PERFORM 1 FROM {{schema}}.workflow_steps AS w
        WHERE w.job_id = ANY(array_remove(chain, NEW.id) || runners)
        ORDER BY w.job_id FOR UPDATE;
        SELECT name INTO step_name FROM {{schema}}.workflow_steps WHERE job_id = NEW.id;
        reason := format('DependencyFailed: step %L (job %s) ended %s', step_name, NEW.id,
                         NEW.status);
        WITH blocked AS (
            UPDATE {{schema}}.workflow_steps AS w
            SET blocked_by = (SELECT min(d.parent_id) FROM {{schema}}.workflow_deps AS d
                              WHERE d.job_id = w.job_id AND d.parent_id = ANY(chain))
            WHERE w.job_id = ANY(array_remove(chain, NEW.id))
            RETURNING w.job_id
        )
        UPDATE {{schema}}.jobs AS j
        SET status = 'cancelled', last_error = reason, run_at = now()
        WHERE j.id = ANY(ARRAY(SELECT job_id FROM blocked)) AND j.status = 'waiting';
        -- One dependency fewer to wait for, per edge from the failed steps.
        WITH edges AS (
            SELECT d.job_id, count(*)::integer AS n
            FROM {{schema}}.workflow_deps AS d
            WHERE d.parent_id = ANY(chain) AND d.job_id = ANY(runners)
            GROUP BY d.job_id
        ),
        counted AS (
            UPDATE {{schema}}.workflow_steps AS w SET remaining = w.remaining - e.n
            FROM edges AS e
            WHERE w.job_id = ANY(ARRAY(
                SELECT j.id FROM {{schema}}.jobs AS j
                WHERE j.id = ANY(runners) AND j.status = 'waiting'))
              AND w.job_id = e.job_id
            RETURNING w.job_id, w.remaining
        ),
        released AS (
            UPDATE {{schema}}.jobs AS j SET status = 'pending', run_at = greatest(j.run_at, now())
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
                SELECT ARRAY(SELECT d.job_id FROM {{schema}}.workflow_deps AS d
                             WHERE d.parent_id = x.job_id) AS ids
            ) AS c
            JOIN {{schema}}.workflow_steps AS w ON w.job_id = ANY(c.ids)
            WHERE w.blocked_by = x.job_id
        )
        SELECT array_agg(job_id) INTO chain FROM revived;
        runners := ARRAY(
            SELECT DISTINCT w.job_id
            FROM {{schema}}.workflow_steps AS w
            WHERE w.job_id = ANY(ARRAY(SELECT d.job_id FROM {{schema}}.workflow_deps AS d
                                       WHERE d.parent_id = ANY(chain)))
              AND w.on_failure = 'run');
        PERFORM 1 FROM {{schema}}.workflow_steps AS w
        WHERE w.job_id = ANY(array_remove(chain, NEW.id) || runners)
        ORDER BY w.job_id FOR UPDATE;
        WITH unblocked AS (
            UPDATE {{schema}}.workflow_steps AS w SET blocked_by = NULL
            WHERE w.job_id = ANY(array_remove(chain, NEW.id))
            RETURNING w.job_id
        )
        UPDATE {{schema}}.jobs AS j
        SET status = 'waiting', last_error = NULL, cancel_requested_at = NULL, run_at = now()
        WHERE j.id = ANY(ARRAY(SELECT job_id FROM unblocked)) AND j.status = 'cancelled';
        -- The steps that run anyway wait for them again, per edge.
        WITH edges AS (
            SELECT d.job_id, count(*)::integer AS n
            FROM {{schema}}.workflow_deps AS d
            WHERE d.parent_id = ANY(chain) AND d.job_id = ANY(runners)
            GROUP BY d.job_id
        )
        UPDATE {{schema}}.workflow_steps AS w SET remaining = w.remaining + e.n
        FROM edges AS e
        WHERE w.job_id = ANY(ARRAY(
            SELECT j.id FROM {{schema}}.jobs AS j
            WHERE j.id = ANY(runners) AND j.status = 'waiting'))
          AND w.job_id = e.job_id;
    END IF;
    RETURN NULL;
END;
$$;

-- A replay makes a step pending; one whose dependencies have not all succeeded waits instead.
CREATE FUNCTION {{schema}}.workflow_step_replayed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM {{schema}}.workflow_steps AS w
               WHERE w.job_id = NEW.id AND w.remaining > 0) THEN
        NEW.status := 'waiting';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER jobs_workflow_step_replayed
    BEFORE UPDATE OF status ON {{schema}}.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND NEW.status = 'pending'
          AND OLD.status IN ('dead', 'cancelled'))
    EXECUTE FUNCTION {{schema}}.workflow_step_replayed();

-- Not for the steps the function itself cancels (waiting, now DependencyFailed) or revives
-- (cancelled as DependencyFailed, now waiting): it handled them in the statement that did.
CREATE TRIGGER jobs_workflow_step_changed
    AFTER UPDATE OF status ON {{schema}}.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND (
        (NEW.status IN ('dead', 'cancelled') AND OLD.status NOT IN ('dead', 'cancelled')
         AND NOT (OLD.status = 'waiting' AND NEW.last_error LIKE 'DependencyFailed:%'))
        OR (OLD.status IN ('dead', 'cancelled') AND NEW.status IN ('pending', 'waiting')
            AND NOT (OLD.status = 'cancelled' AND NEW.status = 'waiting'
                     AND OLD.last_error LIKE 'DependencyFailed:%'))))
    EXECUTE FUNCTION {{schema}}.workflow_step_changed();

-- aioq:migration 16

-- Workflows, second part. A workflow step's delay counts from the moment it becomes ready
-- (docs/workflows.md): the
-- statement that releases it (its last dependency succeeded, or ended for a step that runs
-- anyway) sets run_at = now() + delay. NULL: no delay, or a run_at given as a time (then it
-- stays, or now if past). A step without dependencies counts from the defer, as before; steps
-- deferred before this migration keep the run_at of their defer. The function below is
-- migration 15's with that release, and its doorbell rung as aioq's statements ring it.
ALTER TABLE {{schema}}.workflow_steps ADD COLUMN delay interval;

-- The workflows list (aioq.sql.workflows.LIST_WORKFLOWS) reads each run's succeeded steps from
-- its row, kept by the statement that records their successes (one row update per run and
-- batch of outcomes, after every other lock of that statement), and counts the steps still in
-- jobs per status up to a bound (workflow_counts below): a run of 100 000 steps costs the page
-- at most bound + 1 index entries per status, never the whole run. Runs deferred before this
-- migration have their count filled in here. The jobs index replaces migration 15's
-- (workflow_id), which served the same lookups by run; plain jobs stay out of it.
ALTER TABLE {{schema}}.workflows ADD COLUMN succeeded integer NOT NULL DEFAULT 0;
UPDATE {{schema}}.workflows AS w
SET succeeded = (SELECT count(*) FROM {{schema}}.workflow_steps AS s
                 WHERE s.workflow_id = w.id AND s.succeeded_at IS NOT NULL);
DROP INDEX {{schema}}.jobs_workflow_idx;
CREATE INDEX jobs_workflow_idx ON {{schema}}.jobs (workflow_id, status, id)
    WHERE workflow_id IS NOT NULL;

-- A run's steps still in jobs per status, each counted up to bound + 1 along its index range,
-- in order. The function's planner settings make each count an index scan whatever the
-- statistics say: a run inserted since the last ANALYZE looks small, and the plan chosen for a
-- small range (a bitmap scan, which reads the whole range before the LIMIT, or a sequential
-- scan) would read every step of a run of 100 000.
CREATE FUNCTION {{schema}}.workflow_counts(
    run bigint, bound integer,
    OUT waiting integer, OUT pending integer, OUT running integer, OUT dead integer,
    OUT cancelled integer)
LANGUAGE sql STABLE
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
SELECT
    (SELECT count(*) FROM (
        SELECT FROM {{schema}}.jobs AS j WHERE j.workflow_id = run AND j.status = 'waiting'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM {{schema}}.jobs AS j WHERE j.workflow_id = run AND j.status = 'pending'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM {{schema}}.jobs AS j WHERE j.workflow_id = run AND j.status = 'running'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM {{schema}}.jobs AS j WHERE j.workflow_id = run AND j.status = 'dead'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM {{schema}}.jobs AS j WHERE j.workflow_id = run AND j.status = 'cancelled'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer
$$;

CREATE OR REPLACE FUNCTION {{schema}}.workflow_step_changed() RETURNS trigger
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
    IF NOT EXISTS (SELECT FROM {{schema}}.workflow_deps AS d WHERE d.parent_id = NEW.id) THEN
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
                SELECT ARRAY(SELECT d.job_id FROM {{schema}}.workflow_deps AS d
                             WHERE d.parent_id = x.job_id) AS ids
            ) AS c
            JOIN {{schema}}.workflow_steps AS w ON w.job_id = ANY(c.ids)
            JOIN {{schema}}.jobs AS j ON j.id = ANY(c.ids) AND j.id = w.job_id
            WHERE w.on_failure = 'cancel' AND j.status = 'waiting'
        )
        SELECT array_agg(job_id) INTO chain FROM doomed;
        -- The steps that run anyway, after any of them.
        runners := ARRAY(
            SELECT DISTINCT w.job_id
            FROM {{schema}}.workflow_steps AS w
            WHERE w.job_id = ANY(ARRAY(SELECT d.job_id FROM {{schema}}.workflow_deps AS d
                                       WHERE d.parent_id = ANY(chain)))
              AND w.on_failure = 'run');
        PERFORM 1 FROM {{schema}}.workflow_steps AS w
        WHERE w.job_id = ANY(array_remove(chain, NEW.id) || runners)
        ORDER BY w.job_id FOR UPDATE;
        SELECT name INTO step_name FROM {{schema}}.workflow_steps WHERE job_id = NEW.id;
        reason := format('DependencyFailed: step %L (job %s) ended %s', step_name, NEW.id,
                         NEW.status);
        WITH blocked AS (
            UPDATE {{schema}}.workflow_steps AS w
            SET blocked_by = (SELECT min(d.parent_id) FROM {{schema}}.workflow_deps AS d
                              WHERE d.job_id = w.job_id AND d.parent_id = ANY(chain))
            WHERE w.job_id = ANY(array_remove(chain, NEW.id))
            RETURNING w.job_id
        )
        UPDATE {{schema}}.jobs AS j
        SET status = 'cancelled', last_error = reason, run_at = now()
        WHERE j.id = ANY(ARRAY(SELECT job_id FROM blocked)) AND j.status = 'waiting';
        -- One dependency fewer to wait for, per edge from the failed steps.
        WITH edges AS (
            SELECT d.job_id, count(*)::integer AS n
            FROM {{schema}}.workflow_deps AS d
            WHERE d.parent_id = ANY(chain) AND d.job_id = ANY(runners)
            GROUP BY d.job_id
        ),
        counted AS (
            UPDATE {{schema}}.workflow_steps AS w SET remaining = w.remaining - e.n
            FROM edges AS e
            WHERE w.job_id = ANY(ARRAY(
                SELECT j.id FROM {{schema}}.jobs AS j
                WHERE j.id = ANY(runners) AND j.status = 'waiting'))
              AND w.job_id = e.job_id
            RETURNING w.job_id, w.remaining, w.delay
        ),
        released AS (
            UPDATE {{schema}}.jobs AS j SET status = 'pending',
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
                SELECT ARRAY(SELECT d.job_id FROM {{schema}}.workflow_deps AS d
                             WHERE d.parent_id = x.job_id) AS ids
            ) AS c
            JOIN {{schema}}.workflow_steps AS w ON w.job_id = ANY(c.ids)
            WHERE w.blocked_by = x.job_id
        )
        SELECT array_agg(job_id) INTO chain FROM revived;
        runners := ARRAY(
            SELECT DISTINCT w.job_id
            FROM {{schema}}.workflow_steps AS w
            WHERE w.job_id = ANY(ARRAY(SELECT d.job_id FROM {{schema}}.workflow_deps AS d
                                       WHERE d.parent_id = ANY(chain)))
              AND w.on_failure = 'run');
        PERFORM 1 FROM {{schema}}.workflow_steps AS w
        WHERE w.job_id = ANY(array_remove(chain, NEW.id) || runners)
        ORDER BY w.job_id FOR UPDATE;
        WITH unblocked AS (
            UPDATE {{schema}}.workflow_steps AS w SET blocked_by = NULL
            WHERE w.job_id = ANY(array_remove(chain, NEW.id))
            RETURNING w.job_id
        )
        UPDATE {{schema}}.jobs AS j
        SET status = 'waiting', last_error = NULL, cancel_requested_at = NULL, run_at = now()
        WHERE j.id = ANY(ARRAY(SELECT job_id FROM unblocked)) AND j.status = 'cancelled';
        -- The steps that run anyway wait for them again, per edge.
        WITH edges AS (
            SELECT d.job_id, count(*)::integer AS n
            FROM {{schema}}.workflow_deps AS d
            WHERE d.parent_id = ANY(chain) AND d.job_id = ANY(runners)
            GROUP BY d.job_id
        )
        UPDATE {{schema}}.workflow_steps AS w SET remaining = w.remaining + e.n
        FROM edges AS e
        WHERE w.job_id = ANY(ARRAY(
            SELECT j.id FROM {{schema}}.jobs AS j
            WHERE j.id = ANY(runners) AND j.status = 'waiting'))
          AND w.job_id = e.job_id;
    END IF;
    RETURN NULL;
END;
$$;
