-- The worker that held a job's latest ended claim (retried, dead, cancelled, released or
-- rescued): every statement that ends a claim without deleting the row clears locked_by, so
-- a dead job would otherwise not say where it ran last. Written in the same UPDATE, from the
-- old locked_by; NULL until a claim ends. No default: adding it rewrites nothing.
ALTER TABLE @schema.jobs ADD COLUMN last_worker text;

-- The throughput page's day view summed stats_history over every minute and worker of the day
-- (288,000 rows for 200 workers x queues x tasks: half a second). This is the same history
-- summed over workers per half hour (aioq.queries.ROLLUP_STEP, the day view's step), kept by
-- the same per-minute statement of each worker and pruned with it: the day view reads about
-- 50 rows per queue and task. `minute` is the first minute of the half hour.
CREATE TABLE @schema.stats_rollup (
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
INSERT INTO @schema.stats_rollup
    (minute, queue, task, completed, retried, dead, wait_hist, run_hist)
SELECT c.minute, c.queue, c.task, c.completed, c.retried, c.dead, h.wait_hist, h.run_hist
FROM (
    SELECT date_bin('30 minutes', minute, timestamptz '2000-01-01') AS minute, queue, task,
           sum(completed)::integer AS completed, sum(retried)::integer AS retried,
           sum(dead)::integer AS dead
    FROM @schema.stats_history
    GROUP BY 1, 2, 3
) AS c
JOIN (
    SELECT minute, queue, task, array_agg(w ORDER BY i)::integer[] AS wait_hist,
           array_agg(r ORDER BY i)::integer[] AS run_hist
    FROM (
        SELECT date_bin('30 minutes', s.minute, timestamptz '2000-01-01') AS minute, s.queue,
               s.task, u.i, sum(u.w) AS w, sum(u.r) AS r
        FROM @schema.stats_history AS s,
             unnest(s.wait_hist, s.run_hist) WITH ORDINALITY AS u(w, r, i)
        GROUP BY 1, 2, 3, 4
    ) AS per_bucket
    GROUP BY 1, 2, 3
) AS h USING (minute, queue, task);
