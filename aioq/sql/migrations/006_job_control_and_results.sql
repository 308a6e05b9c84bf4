-- Job control: cancelled as a kept terminal state, cancel requests for running jobs,
-- progress, and stored results of tasks with a result_ttl.

ALTER TABLE @schema.jobs
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
CREATE TABLE @schema.results (
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

CREATE INDEX results_expires_at_idx ON @schema.results (expires_at);
