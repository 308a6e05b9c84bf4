-- aioq.web.sql.DASH_UNKNOWN_TASKS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :cap
SELECT queue, task, count(*) AS n, min(unknown_since) AS since,
       sum(count(*)) OVER ()::integer AS sampled
FROM (SELECT queue, task, unknown_since FROM "aioq".jobs
      WHERE unknown_since IS NOT NULL AND status = 'pending' LIMIT $1) AS u
GROUP BY queue, task
ORDER BY queue, task
