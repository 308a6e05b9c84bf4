-- aioq.sql.history.RECORD_STATS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :worker, $2 :host, $3 :pid, $4 :queues, $5 :concurrency, $6 :queue_names, $7 :tasks, $8 :completed, $9 :retried, $10 :dead, $11 :wait_hist, $12 :run_hist, $13 :buckets (the fields of aioq.sql.history.RecordStats)
WITH me AS (
    INSERT INTO "aioq".workers AS w (id, host, pid, queues, concurrency)
    VALUES ($1, $2, $3, $4::text[], $5)
    ON CONFLICT (id) DO UPDATE
    SET last_seen = now(), queues = excluded.queues, concurrency = excluded.concurrency
),
counts AS (
    SELECT c.queue, c.task, c.completed, c.retried, c.dead,
           ($11::integer[])[(c.n - 1) * $13 + 1 : c.n * $13] AS wait_hist,
           ($12::integer[])[(c.n - 1) * $13 + 1 : c.n * $13] AS run_hist
    FROM unnest($6::text[], $7::text[], $8::integer[],
                $9::integer[], $10::integer[])
         WITH ORDINALITY AS c(queue, task, completed, retried, dead, n)
),
rolled AS (
    INSERT INTO "aioq".stats_rollup AS h
        (minute, queue, task, completed, retried, dead, wait_hist, run_hist)
    SELECT date_bin(make_interval(secs => 1800), now(), timestamptz '2000-01-01'),
           queue, task, completed, retried, dead, wait_hist, run_hist
    FROM counts
    ORDER BY queue, task
    ON CONFLICT (minute, queue, task) DO UPDATE
    SET completed = h.completed + excluded.completed,
        retried = h.retried + excluded.retried,
        dead = h.dead + excluded.dead,
        wait_hist = (SELECT array_agg(a + b ORDER BY i)
                     FROM unnest(h.wait_hist, excluded.wait_hist) WITH ORDINALITY AS x(a, b, i)),
        run_hist = (SELECT array_agg(a + b ORDER BY i)
                    FROM unnest(h.run_hist, excluded.run_hist) WITH ORDINALITY AS x(a, b, i))
)
INSERT INTO "aioq".stats_history AS h
    (minute, worker, queue, task, completed, retried, dead, wait_hist, run_hist)
SELECT date_trunc('minute', now()), $1, queue, task, completed, retried, dead, wait_hist,
       run_hist
FROM counts
ON CONFLICT (minute, worker, queue, task) DO UPDATE
SET completed = h.completed + excluded.completed,
    retried = h.retried + excluded.retried,
    dead = h.dead + excluded.dead,
    wait_hist = (SELECT array_agg(a + b ORDER BY i)
                 FROM unnest(h.wait_hist, excluded.wait_hist) WITH ORDINALITY AS x(a, b, i)),
    run_hist = (SELECT array_agg(a + b ORDER BY i)
                FROM unnest(h.run_hist, excluded.run_hist) WITH ORDINALITY AS x(a, b, i))
