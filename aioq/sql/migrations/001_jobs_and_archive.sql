CREATE TABLE @schema.jobs (
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
CREATE INDEX jobs_claim_idx ON @schema.jobs (queue, priority DESC, run_at, id)
    WHERE status = 'pending';

-- The reaper's scan: only running rows, so it stays the size of the in-flight set.
CREATE INDEX jobs_lease_idx ON @schema.jobs (lease_expires_at) WHERE status = 'running';

-- At most one live job per unique_key.
CREATE UNIQUE INDEX jobs_unique_key_idx ON @schema.jobs (unique_key)
    WHERE unique_key IS NOT NULL AND status IN ('pending', 'running');

-- Inspection and replay of dead jobs by task or queue.
CREATE INDEX jobs_dead_idx ON @schema.jobs (task, queue) WHERE status = 'dead';

-- Completed jobs, kept only when a worker runs with keep_completed=True; pruned in batches.
CREATE TABLE @schema.archive (
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

CREATE INDEX archive_finished_at_idx ON @schema.archive (finished_at);

-- The doorbell: one NOTIFY per queue per statement (and PostgreSQL folds duplicates within a
-- transaction), sent only at commit, carrying the queue name and no job data.
CREATE FUNCTION @schema.ring_doorbell() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE run_at <= now()) AS q;
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_doorbell
    AFTER INSERT ON @schema.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION @schema.ring_doorbell();
