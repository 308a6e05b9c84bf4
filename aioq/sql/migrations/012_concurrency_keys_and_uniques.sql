-- Per-key concurrency (docs/architecture.md, "Per-key concurrency"): a job may carry a key (a
-- tenant, an account), and a queue may cap the jobs of one key running at once across the
-- fleet. Both indexes hold keyed jobs only, so jobs without a key cost them nothing; the claim
-- of a queue without max_running_per_key never reads them.
ALTER TABLE @schema.jobs ADD COLUMN concurrency_key text;
ALTER TABLE @schema.queues ADD COLUMN max_running_per_key integer
    CONSTRAINT queues_max_running_per_key_check CHECK (max_running_per_key >= 1);

-- The keyed claim: a skip scan over the distinct keys of a queue's pending jobs, then per key
-- the first jobs in claim order (the same ORDER BY as jobs_claim_idx).
CREATE INDEX jobs_key_claim_idx ON @schema.jobs (queue, concurrency_key, priority DESC, run_at, id)
    WHERE status = 'pending' AND concurrency_key IS NOT NULL;

-- Running jobs per key: each key's count reads at most its own running jobs (at most
-- max_running_per_key of them), never the whole running set.
CREATE INDEX jobs_key_running_idx ON @schema.jobs (queue, concurrency_key)
    WHERE status = 'running' AND concurrency_key IS NOT NULL;

-- Unique jobs over a window (docs/architecture.md, "Unique jobs"): a defer with unique_for
-- records here which job holds its key until when, in the statement that inserts the job; a
-- defer of the key before expires_at returns that job's id, even once the job has left the
-- jobs table. The primary key serializes concurrent defers of one key. Expired rows are
-- pruned in batches; a defer after the expiry takes the row over.
CREATE TABLE @schema.uniques (
    key text PRIMARY KEY,
    job_id bigint NOT NULL,
    expires_at timestamptz NOT NULL
);

CREATE INDEX uniques_expires_at_idx ON @schema.uniques (expires_at);
