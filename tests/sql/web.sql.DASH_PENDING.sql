-- aioq.web.sql.DASH_PENDING, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queues, $2 :cap, $3 :priorities
WITH RECURSIVE names(queue, n) AS (
    (SELECT queue, 1 FROM "aioq".jobs WHERE status = 'pending' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM "aioq".jobs AS j
            WHERE j.status = 'pending' AND j.queue > names.queue
            ORDER BY j.queue LIMIT 1),
           names.n + 1
    FROM names WHERE names.queue IS NOT NULL AND names.n < $1
)
SELECT names.queue, p.ready, p.scheduled, p.sampled,
       coalesce(extract(epoch FROM now() - o.oldest_ready), 0)::float8 AS oldest_ready_age
FROM names
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE s.run_at <= now()) AS ready,
           count(*) FILTER (WHERE s.run_at > now()) AS scheduled,
           count(*) AS sampled
    FROM (SELECT run_at FROM "aioq".jobs
          WHERE status = 'pending' AND queue = names.queue
          ORDER BY priority DESC, run_at, id
          LIMIT $2) AS s
) AS p
CROSS JOIN LATERAL (
    WITH RECURSIVE firsts(priority, run_at, n) AS (
        (SELECT priority, run_at, 1 FROM "aioq".jobs
         WHERE status = 'pending' AND queue = names.queue
         ORDER BY priority DESC, run_at, id LIMIT 1)
        UNION ALL
        SELECT nx.priority, nx.run_at, firsts.n + 1
        FROM firsts
        CROSS JOIN LATERAL (
            SELECT j.priority, j.run_at FROM "aioq".jobs AS j
            WHERE j.status = 'pending' AND j.queue = names.queue AND j.priority < firsts.priority
            ORDER BY priority DESC, run_at, id LIMIT 1
        ) AS nx
        WHERE firsts.n < $3
    )
    SELECT min(run_at) FILTER (WHERE run_at <= now()) AS oldest_ready FROM firsts
) AS o
WHERE names.queue IS NOT NULL
ORDER BY names.queue
