-- Jobs whose task a worker does not know (a deploy in progress: the code that defers a task
-- runs before any worker that runs it). The first worker that claims such a job hands it on,
-- its attempt refunded, and marks it with the time: the job then waits, claimable by any
-- worker that knows its task, skipped by those that found they do not (their claim names the
-- tasks they do not know), until a worker's unknown_task_grace since this time has passed
-- (then such a worker makes it dead). An attempt of a worker that knows the task clears it.
-- docs/architecture.md, "Unknown tasks".
ALTER TABLE @schema.jobs ADD COLUMN unknown_since timestamptz;

-- Jobs waiting for a worker that knows their task, per queue and task (the statistics, the
-- dashboard): none in a steady state, so it costs the hot path nothing.
CREATE INDEX jobs_unknown_idx ON @schema.jobs (queue, task, unknown_since)
    WHERE unknown_since IS NOT NULL AND status = 'pending';
