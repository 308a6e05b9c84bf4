-- aioq.web.sql.ROLLUP_SERIES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :seconds, $2 :step, $3 :queue
SELECT date_bin(make_interval(secs => $2::float8), minute, timestamptz '2000-01-01') AS t,
       CASE WHEN $3::text IS NULL THEN queue ELSE task END AS name,
       sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead
FROM "aioq".stats_rollup
WHERE minute > now() - make_interval(secs => $1::float8 + 1800)
  AND ($3::text IS NULL OR queue = $3)
GROUP BY 1, 2
ORDER BY 1, 2
