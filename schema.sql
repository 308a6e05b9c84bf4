-- aioq's schema as it is: every table, index, function and trigger at the latest migration
-- (version 19), in the default schema `aioq`, with what each part is for. Read it to review
-- the schema, to plan grants or capacity, or to see what a column holds.
--
-- A database gets the schema from the migrations, not from this file: `aioq schema apply`
-- (or `await aioq.install(conn)`, or the script `aioq schema sql` prints for a migration tool)
-- applies aioq/sql/migrations/NNN_name.sql in order, each once, and records it. This file is
-- what they add up to, and a test holds it to that (tests/test_migrations.py): a database that
-- ran this file and one that ran the migrations have the same catalog, column by column (in
-- order), constraint, index, function, trigger and sequence. `make schema` runs that test and
-- prints what differs; a new migration updates this file in the same commit.
--
-- Run on a database without the schema (psql -v ON_ERROR_STOP=1 --single-transaction -f
-- schema.sql), it creates the schema at version 19, recorded as an install records it; where
-- `aioq` exists, it stops at CREATE SCHEMA. It leaves out the opt-in doorbell trigger for
-- raw-SQL inserts (aioq/sql/ring_trigger.sql, `aioq schema apply --ring-trigger`).
-- docs/architecture.md, "Tables", tells how the tables serve the worker.

CREATE SCHEMA aioq;

-- Which migrations were applied, one row each (aioq.migrate). `aioq schema apply` reads the
-- highest version and applies the files above it, under an advisory lock per schema.
CREATE TABLE aioq.migrations (
    version integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- ---------------------------------------------------------------------------------------------
-- Jobs
-- ---------------------------------------------------------------------------------------------

-- One row per job that has not ended, plus the dead and cancelled ones until the pruner removes
-- them. A job that succeeds leaves the table in the statement that records its success
-- (deleted, or moved to archive or results). Columns in the order the migrations added them.
CREATE TABLE aioq.jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL DEFAULT 'default',
    task text NOT NULL,
    -- The task's keyword arguments in plain JSON.
    args jsonb NOT NULL DEFAULT '{}',
    -- waiting (a workflow step whose dependencies have not all succeeded), pending, running,
    -- and the kept terminal states dead and cancelled.
    status text NOT NULL DEFAULT 'pending'
        CONSTRAINT jobs_status_check
        CHECK (status IN ('pending', 'running', 'dead', 'cancelled', 'waiting')),
    -- Higher first; run_at is "not before", in database time.
    priority integer NOT NULL DEFAULT 0,
    run_at timestamptz NOT NULL DEFAULT now(),
    -- attempts counts runs; after max_attempts the job is dead (a snooze adds one to
    -- max_attempts, so that snoozing never spends the job's attempts).
    attempts integer NOT NULL DEFAULT 0,
    max_attempts integer NOT NULL DEFAULT 5 CONSTRAINT jobs_max_attempts_check CHECK (max_attempts >= 1),
    -- How long a claim of this job holds unless its worker's heartbeat extends it.
    lease interval NOT NULL DEFAULT interval '30 seconds'
        CONSTRAINT jobs_lease_check CHECK (lease > interval '0'),
    -- The current claim's owner and lease: set by the claim, cleared by whatever ends it.
    locked_by text,
    locked_at timestamptz,
    lease_expires_at timestamptz,
    -- The last failure: type, message, bounded traceback.
    last_error text,
    -- Unique among live jobs (pending or running): jobs_unique_key_idx.
    unique_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Claim identity. `claims` counts the claims of a job and never decreases (a snooze, a
    -- release or a replay leaves it alone, where `attempts` is refunded or reset), so (id,
    -- claims) names one claim among all of a job's claims: every write after the claim is
    -- fenced on it, and a stale write (a lost lease, a retried write whose reply was lost)
    -- matches no later claim.
    claims integer NOT NULL DEFAULT 0,
    -- The runs that ended in aioq.Retry; each also added one to max_attempts.
    snoozes integer NOT NULL DEFAULT 0,
    -- The W3C traceparent of the span that deferred the job (aioq.contrib.otel), NULL when no
    -- tracer was recording: the worker's span for the run continues that trace.
    traceparent text,
    -- The tick a periodic job was enqueued for (NULL for other jobs); the task reads it from
    -- aioq.current_job().scheduled_at.
    scheduled_at timestamptz,
    -- Set by cancel_jobs on a running job; its worker cancels the run and records `cancelled`.
    -- A job that leaves `running` any other way while it is set never runs again.
    cancel_requested_at timestamptz,
    progress double precision
        CONSTRAINT jobs_progress_check CHECK (progress BETWEEN 0 AND 1),
    progress_note text,
    -- The worker that held the job's latest ended claim (retried, dead, cancelled, released or
    -- rescued): every statement that ends a claim without deleting the row clears locked_by
    -- and writes this from it, so a dead job says where it ran last. NULL until a claim ends.
    last_worker text,
    -- Per-key concurrency (docs/architecture.md, "Per-key concurrency"): a tenant, an account,
    -- whose running jobs a queue's max_running_per_key caps across the fleet.
    concurrency_key text,
    -- The workflow run of a step (docs/architecture.md, "Workflows"); NULL for plain jobs.
    workflow_id bigint,
    -- A workflow step cancelled because a dependency failed: that dependency's job id (the
    -- workflow trigger sets it with the cancel and clears it when a replay revives the step).
    -- The trigger tells its own cascade apart by it, never by the text of last_error.
    blocked_by bigint,
    -- When a worker that does not know the job's task first claimed it (a deploy in
    -- progress): the job waits for a worker that knows it, its attempts unspent, until a
    -- worker's unknown_task_grace since then has passed (docs/architecture.md, "Unknown
    -- tasks"). Cleared by an attempt of a worker that knows the task.
    unknown_since timestamptz,
    -- A running job always has an owner and a lease: the fence needs both.
    CONSTRAINT jobs_running_locked CHECK (
        status <> 'running' OR (locked_by IS NOT NULL AND lease_expires_at IS NOT NULL)
    ),
    -- Every path out of `running` turns a requested cancel into `cancelled`; this makes one
    -- that forgets fail loudly instead of running a cancelled job again.
    CONSTRAINT jobs_pending_not_cancelled
        CHECK (status <> 'pending' OR cancel_requested_at IS NULL)
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

-- Job arguments (jsonb, often kilobytes) are TOASTed and compressed past about 2 KB; lz4
-- compresses a 64 KB argument in a third of pglz's time and decompresses it several times
-- faster, for the claim. A server built without lz4 (or older than PostgreSQL 14) keeps pglz.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE aioq.jobs ALTER COLUMN args SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR syntax_error THEN
    NULL;
END
$$;

-- Matches the claim exactly: WHERE status = 'pending' AND queue = $1 AND run_at <= now()
-- ORDER BY priority DESC, run_at, id. Dead rows are not in it, so history costs the claim
-- nothing; nor are waiting workflow steps, so the claim never sees them.
CREATE INDEX jobs_claim_idx ON aioq.jobs (queue, priority DESC, run_at, id)
    WHERE status = 'pending';

-- The keyed claim: a skip scan over the distinct keys of a queue's pending jobs, then per key
-- the first jobs in claim order (the same ORDER BY as jobs_claim_idx). Keyed jobs only, so
-- jobs without a key cost it nothing.
CREATE INDEX jobs_key_claim_idx ON aioq.jobs (queue, concurrency_key, priority DESC, run_at, id)
    WHERE status = 'pending' AND concurrency_key IS NOT NULL;

-- Running jobs per key: each key's count reads at most its own running jobs (at most
-- max_running_per_key of them), never the whole running set.
CREATE INDEX jobs_key_running_idx ON aioq.jobs (queue, concurrency_key)
    WHERE status = 'running' AND concurrency_key IS NOT NULL;

-- The reaper's scan: only running rows, so it stays the size of the in-flight set.
CREATE INDEX jobs_lease_idx ON aioq.jobs (lease_expires_at) WHERE status = 'running';

-- At most one live job per unique_key.
CREATE UNIQUE INDEX jobs_unique_key_idx ON aioq.jobs (unique_key)
    WHERE unique_key IS NOT NULL AND status IN ('pending', 'running');

-- Inspection and replay of dead jobs by task or queue.
CREATE INDEX jobs_dead_idx ON aioq.jobs (task, queue) WHERE status = 'dead';

-- The dashboard lists dead jobs newest first by keyset (id < cursor): without an index ordered
-- by id among dead rows alone, that page would walk the primary key past every live job.
-- Dead rows are off the hot path, so this costs the claim and the completion nothing.
CREATE INDEX jobs_dead_id_idx ON aioq.jobs (id) WHERE status = 'dead';

-- The same for cancelled jobs (kept like dead ones until pruned), and what lets the overview
-- count them per queue without reading the table.
CREATE INDEX jobs_cancelled_id_idx ON aioq.jobs (id) WHERE status = 'cancelled';

-- A run's steps, by status in id order (aioq.workflow(), cancel_workflow(), workflow_counts()
-- below); plain jobs are not in it.
CREATE INDEX jobs_workflow_idx ON aioq.jobs (workflow_id, status, id)
    WHERE workflow_id IS NOT NULL;

-- Jobs waiting for a worker that knows their task, per queue and task (the statistics, the
-- dashboard): none in a steady state, so it costs the hot path nothing.
CREATE INDEX jobs_unknown_idx ON aioq.jobs (queue, task, unknown_since)
    WHERE unknown_since IS NOT NULL AND status = 'pending';

-- Completed jobs, kept only when a worker runs with keep_completed=True; pruned in batches.
CREATE TABLE aioq.archive (
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

CREATE INDEX archive_finished_at_idx ON aioq.archive (finished_at);

-- Return values of tasks with a result_ttl, kept until expires_at; the pruner deletes expired
-- rows in bounded batches. A row here means the job succeeded; it left the jobs table in the
-- same statement that wrote this row.
CREATE TABLE aioq.results (
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

CREATE INDEX results_expires_at_idx ON aioq.results (expires_at);

-- Unique jobs over a window (docs/architecture.md, "Unique jobs"): a defer with unique_for
-- records here which job holds its key until when, in the statement that inserts the job; a
-- defer of the key before expires_at returns that job's id, even once the job has left the
-- jobs table. The primary key serializes concurrent defers of one key. Expired rows are
-- pruned in batches; a defer after the expiry takes the row over.
CREATE TABLE aioq.uniques (
    key text PRIMARY KEY,
    job_id bigint NOT NULL,
    expires_at timestamptz NOT NULL
);

CREATE INDEX uniques_expires_at_idx ON aioq.uniques (expires_at);

-- ---------------------------------------------------------------------------------------------
-- Periodic jobs
-- ---------------------------------------------------------------------------------------------

-- One row per schedule: the latest tick enqueued. A tick's job is inserted in the same
-- statement that advances last_tick, conditioned on last_tick being older, so each tick is
-- enqueued once whatever the number of workers, even after its job left the table.
CREATE TABLE aioq.schedules (
    name text PRIMARY KEY,
    task text NOT NULL,
    queue text NOT NULL,
    spec text NOT NULL,               -- "every 60s" or "cron */5 * * * * Europe/Paris"
    last_tick timestamptz NOT NULL,   -- the latest tick enqueued (or skipped at first sight)
    next_tick timestamptz,            -- the tick after it, as the last writer computed it
    updated_at timestamptz NOT NULL DEFAULT now(),
    -- Whether last_tick was enqueued: at first sight a worker records the latest past tick as
    -- done without enqueuing it, and `aioq schedules` shows such a schedule's last tick as
    -- never. (Rows from before this column, migration 13, count as ticked.)
    ticked boolean NOT NULL DEFAULT false
);

-- ---------------------------------------------------------------------------------------------
-- Queue limits
-- ---------------------------------------------------------------------------------------------

-- Queue limits and pauses, read by every worker, so the whole fleet obeys them. A queue with
-- no row here (or with no limit set and not paused) is claimed by the plain claim statement and
-- pays nothing for this; a limited queue's claims lock its row, so they take turns, and count
-- what they may take in a fresh snapshot under that lock.
CREATE TABLE aioq.queues (
    name text PRIMARY KEY,
    max_running integer CONSTRAINT queues_max_running_check CHECK (max_running >= 1),
    rate_limit integer CONSTRAINT queues_rate_limit_check CHECK (rate_limit >= 1),
    rate_period interval CONSTRAINT queues_rate_period_check CHECK (rate_period > interval '0'),
    paused boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now(),
    -- The jobs of one concurrency_key running at once, across the fleet.
    max_running_per_key integer
        CONSTRAINT queues_max_running_per_key_check CHECK (max_running_per_key >= 1),
    CONSTRAINT queues_rate_pair CHECK ((rate_limit IS NULL) = (rate_period IS NULL))
);

-- Claims of rate-limited queues, counted per slot of a tenth of the period. A claim counts
-- every slot that overlaps the last period, so the count never falls short of the claims
-- really made in any window of that length (it may exceed them by up to one slot).
CREATE TABLE aioq.queue_claims (
    queue text NOT NULL,
    slot_start timestamptz NOT NULL,
    slot_end timestamptz NOT NULL,
    claims integer NOT NULL,
    PRIMARY KEY (queue, slot_start)
);

-- ---------------------------------------------------------------------------------------------
-- The doorbell
-- ---------------------------------------------------------------------------------------------

-- A name's duty key, as the advisory lock functions' 64-bit form takes it: the queue's, or for
-- the empty name (no queue has it) the wildcard's, "any queue" (docs/architecture.md, "The
-- doorbell"). pg_locks shows a key as classid (its high 32 bits) and objid (its low 32 bits),
-- objsubid 1 (docs/operations-and-cli.md). The workflow trigger and the opt-in trigger for
-- raw-SQL inserts ring with it; aioq's own statements compute the same expression in place.
CREATE FUNCTION aioq.doorbell_key(queue text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT hashtextextended(queue, 'aioq.jobs'::regclass::oid::bigint) $$;

-- ---------------------------------------------------------------------------------------------
-- Workers and history (the dashboard)
-- ---------------------------------------------------------------------------------------------

-- Workers record themselves here (the stats writer upserts its row every minute and deletes it
-- on a clean stop), so the dashboard can list them without asking the workers anything.
CREATE TABLE aioq.workers (
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
-- bucket of the stats history's BUCKETS (seconds); summed across rows they give percentiles.
CREATE TABLE aioq.stats_history (
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

-- The same history summed over workers per half hour (aioq.sql.history.ROLLUP_STEP, the
-- throughput page's day view), kept by the same per-minute statement of each worker and pruned
-- with it: the day view reads about 50 rows per queue and task instead of every minute and
-- worker of the day. `minute` is the first minute of the half hour.
CREATE TABLE aioq.stats_rollup (
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

-- ---------------------------------------------------------------------------------------------
-- Workflows (docs/architecture.md, "Workflows")
-- ---------------------------------------------------------------------------------------------

-- Steps with dependencies, deferred together in the caller's transaction. A step is a job (its
-- row in jobs, with workflow_id set) plus its bookkeeping here. A step whose dependencies have
-- not all succeeded is `waiting`: not in the claim's partial index, so the claim never sees
-- it. The statement that records a step's success (aioq.sql.outcomes.WRITE_STEP_OUTCOMES)
-- decrements its dependents' `remaining` under their step rows' locks and makes those that
-- reach zero pending: each success is recorded once (the fence), so each fan-in happens once.
-- Plain jobs keep workflow_id NULL and pay for none of it but the triggers' WHEN test on a
-- status change.
CREATE TABLE aioq.workflows (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    steps integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- The run's succeeded steps, kept by the statement that records their successes (one row
    -- update per run and batch of outcomes, after every other lock of that statement): the
    -- workflows list reads it here, and counts the steps still in jobs with workflow_counts().
    succeeded integer NOT NULL DEFAULT 0
);

CREATE INDEX workflows_created_at_idx ON aioq.workflows (created_at);

-- One row per step, kept while the run lives (its job row leaves jobs when it succeeds).
CREATE TABLE aioq.workflow_steps (
    job_id bigint PRIMARY KEY,
    workflow_id bigint NOT NULL,
    name text NOT NULL,
    task text NOT NULL,
    -- Dependencies still to succeed (on_failure 'run': still to end).
    remaining integer NOT NULL,
    on_failure text NOT NULL DEFAULT 'cancel'
        CONSTRAINT workflow_steps_on_failure_check CHECK (on_failure IN ('cancel', 'run')),
    -- Written by the statement that recorded its success.
    succeeded_at timestamptz,
    result jsonb,
    -- The step's delay counts from the moment it becomes ready (docs/workflows.md): the
    -- statement that releases it sets run_at = now() + delay. NULL: no delay, or a run_at
    -- given as a time (then it stays, or now if past).
    delay interval,
    CONSTRAINT workflow_steps_name_key UNIQUE (workflow_id, name)
);

-- The dependency edges: job_id runs after parent_id. By parent for the fan-in, by dependent
-- for upstream().
CREATE TABLE aioq.workflow_deps (
    parent_id bigint NOT NULL,
    job_id bigint NOT NULL,
    PRIMARY KEY (parent_id, job_id)
);

CREATE INDEX workflow_deps_job_idx ON aioq.workflow_deps (job_id);

-- A run's steps still in jobs per status, each counted up to bound + 1 along its index range,
-- in order. The function's planner settings make each count an index scan whatever the
-- statistics say: a run inserted since the last ANALYZE looks small, and the plan chosen for a
-- small range (a bitmap scan, which reads the whole range before the LIMIT, or a sequential
-- scan) would read every step of a run of 100 000.
CREATE FUNCTION aioq.workflow_counts(
    run bigint, bound integer,
    OUT waiting integer, OUT pending integer, OUT running integer, OUT dead integer,
    OUT cancelled integer)
LANGUAGE sql STABLE
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
SELECT
    (SELECT count(*) FROM (
        SELECT FROM aioq.jobs AS j WHERE j.workflow_id = run AND j.status = 'waiting'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM aioq.jobs AS j WHERE j.workflow_id = run AND j.status = 'pending'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM aioq.jobs AS j WHERE j.workflow_id = run AND j.status = 'running'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM aioq.jobs AS j WHERE j.workflow_id = run AND j.status = 'dead'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer,
    (SELECT count(*) FROM (
        SELECT FROM aioq.jobs AS j WHERE j.workflow_id = run AND j.status = 'cancelled'
        ORDER BY j.id LIMIT bound + 1) AS c)::integer
$$;

-- A step ended dead or cancelled, by whatever path (an outcome, the reaper, a cancel, a
-- cancelled run): the waiting steps that need it, directly or through others, are cancelled in
-- one statement (a recursive query over the edges, never a recursion of triggers: the steps it
-- cancels do not fire this again, their WHEN is false), each naming the step that failed and
-- remembering the dependency that blocked it (jobs.blocked_by); the steps that run anyway (on_failure 'run')
-- count each of these as ended. A step replayed (dead to pending or waiting) revives the steps
-- it blocked the same way. Every step row it writes is locked first, in one pass in id order,
-- then their job rows: as WRITE_STEP_OUTCOMES does.
CREATE FUNCTION aioq.workflow_step_changed() RETURNS trigger
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
    IF NOT EXISTS (SELECT FROM aioq.workflow_deps AS d WHERE d.parent_id = NEW.id) THEN
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
                SELECT ARRAY(SELECT d.job_id FROM aioq.workflow_deps AS d
                             WHERE d.parent_id = x.job_id) AS ids
            ) AS c
            JOIN aioq.workflow_steps AS w ON w.job_id = ANY(c.ids)
            JOIN aioq.jobs AS j ON j.id = ANY(c.ids) AND j.id = w.job_id
            WHERE w.on_failure = 'cancel' AND j.status = 'waiting'
        )
        SELECT array_agg(job_id) INTO chain FROM doomed;
        -- The steps that run anyway, after any of them.
        runners := ARRAY(
            SELECT DISTINCT w.job_id
            FROM aioq.workflow_steps AS w
            WHERE w.job_id = ANY(ARRAY(SELECT d.job_id FROM aioq.workflow_deps AS d
                                       WHERE d.parent_id = ANY(chain)))
              AND w.on_failure = 'run');
        PERFORM 1 FROM aioq.workflow_steps AS w
        WHERE w.job_id = ANY(array_remove(chain, NEW.id) || runners)
        ORDER BY w.job_id FOR UPDATE;
        SELECT name INTO step_name FROM aioq.workflow_steps WHERE job_id = NEW.id;
        reason := format('DependencyFailed: step %L (job %s) ended %s', step_name, NEW.id,
                         NEW.status);
        -- Each remembers the dependency that blocked it (in the chain): a replay of that one
        -- revives it.
        UPDATE aioq.jobs AS j
        SET status = 'cancelled', last_error = reason, run_at = now(),
            blocked_by = (SELECT min(d.parent_id) FROM aioq.workflow_deps AS d
                          WHERE d.job_id = j.id AND d.parent_id = ANY(chain))
        WHERE j.id = ANY(array_remove(chain, NEW.id)) AND j.status = 'waiting';
        -- One dependency fewer to wait for, per edge from the failed steps.
        WITH edges AS (
            SELECT d.job_id, count(*)::integer AS n
            FROM aioq.workflow_deps AS d
            WHERE d.parent_id = ANY(chain) AND d.job_id = ANY(runners)
            GROUP BY d.job_id
        ),
        counted AS (
            UPDATE aioq.workflow_steps AS w SET remaining = w.remaining - e.n
            FROM edges AS e
            WHERE w.job_id = ANY(ARRAY(
                SELECT j.id FROM aioq.jobs AS j
                WHERE j.id = ANY(runners) AND j.status = 'waiting'))
              AND w.job_id = e.job_id
            RETURNING w.job_id, w.remaining, w.delay
        ),
        released AS (
            UPDATE aioq.jobs AS j SET status = 'pending',
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
        WHERE CASE WHEN pg_try_advisory_xact_lock_shared(aioq.doorbell_key(q.queue))
                   THEN NOT (pg_try_advisory_lock_shared(aioq.doorbell_key(''))
                             AND pg_advisory_unlock_shared(aioq.doorbell_key('')))
                   ELSE true END;
    ELSE
        -- Replayed: the steps it blocked, directly or through others, wait again.
        WITH RECURSIVE revived(job_id) AS (
            SELECT NEW.id
            UNION
            SELECT j.id
            FROM revived AS x
            CROSS JOIN LATERAL (
                SELECT ARRAY(SELECT d.job_id FROM aioq.workflow_deps AS d
                             WHERE d.parent_id = x.job_id) AS ids
            ) AS c
            JOIN aioq.jobs AS j ON j.id = ANY(c.ids)
            WHERE j.blocked_by = x.job_id
        )
        SELECT array_agg(job_id) INTO chain FROM revived;
        runners := ARRAY(
            SELECT DISTINCT w.job_id
            FROM aioq.workflow_steps AS w
            WHERE w.job_id = ANY(ARRAY(SELECT d.job_id FROM aioq.workflow_deps AS d
                                       WHERE d.parent_id = ANY(chain)))
              AND w.on_failure = 'run');
        PERFORM 1 FROM aioq.workflow_steps AS w
        WHERE w.job_id = ANY(array_remove(chain, NEW.id) || runners)
        ORDER BY w.job_id FOR UPDATE;
        UPDATE aioq.jobs AS j
        SET status = 'waiting', blocked_by = NULL, last_error = NULL, cancel_requested_at = NULL,
            run_at = now()
        WHERE j.id = ANY(array_remove(chain, NEW.id)) AND j.status = 'cancelled'
          AND j.blocked_by IS NOT NULL;
        -- The steps that run anyway wait for them again, per edge.
        WITH edges AS (
            SELECT d.job_id, count(*)::integer AS n
            FROM aioq.workflow_deps AS d
            WHERE d.parent_id = ANY(chain) AND d.job_id = ANY(runners)
            GROUP BY d.job_id
        )
        UPDATE aioq.workflow_steps AS w SET remaining = w.remaining + e.n
        FROM edges AS e
        WHERE w.job_id = ANY(ARRAY(
            SELECT j.id FROM aioq.jobs AS j
            WHERE j.id = ANY(runners) AND j.status = 'waiting'))
          AND w.job_id = e.job_id;
    END IF;
    RETURN NULL;
END;
$$;

-- A replay makes a step pending; one whose dependencies have not all succeeded waits instead.
CREATE FUNCTION aioq.workflow_step_replayed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM aioq.workflow_steps AS w
               WHERE w.job_id = NEW.id AND w.remaining > 0) THEN
        NEW.status := 'waiting';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER jobs_workflow_step_replayed
    BEFORE UPDATE OF status ON aioq.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND NEW.status = 'pending'
          AND OLD.status IN ('dead', 'cancelled'))
    EXECUTE FUNCTION aioq.workflow_step_replayed();

-- Not for the steps the function itself cancels (waiting to cancelled, blocked_by set) or
-- revives (cancelled with blocked_by set, to waiting): it handled them in the statement that
-- did. A step cancelled by a cancel (blocked_by NULL), whatever its reason says, cascades.
CREATE TRIGGER jobs_workflow_step_changed
    AFTER UPDATE OF status ON aioq.jobs
    FOR EACH ROW
    WHEN (NEW.workflow_id IS NOT NULL AND (
        (NEW.status IN ('dead', 'cancelled') AND OLD.status NOT IN ('dead', 'cancelled')
         AND NEW.blocked_by IS NULL)
        OR (OLD.status IN ('dead', 'cancelled') AND NEW.status IN ('pending', 'waiting')
            AND OLD.blocked_by IS NULL)))
    EXECUTE FUNCTION aioq.workflow_step_changed();

-- ---------------------------------------------------------------------------------------------
-- The version
-- ---------------------------------------------------------------------------------------------

-- The migrations this file adds up to, recorded: `aioq schema status` reports it up to date.
INSERT INTO aioq.migrations (version) SELECT generate_series(1, 19);
