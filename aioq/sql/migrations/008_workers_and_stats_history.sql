-- Workers record themselves here (the stats writer upserts its row every minute and deletes it
-- on a clean stop), so the dashboard can list them without asking the workers anything.
CREATE TABLE @schema.workers (
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
CREATE TABLE @schema.stats_history (
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
CREATE INDEX jobs_dead_id_idx ON @schema.jobs (id) WHERE status = 'dead';

-- The same for cancelled jobs (kept like dead ones until pruned), and what lets the overview
-- count them per queue without reading the table.
CREATE INDEX jobs_cancelled_id_idx ON @schema.jobs (id) WHERE status = 'cancelled';
