-- aioq.web.sql.ROLLUP_TOTALS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :seconds
SELECT queue, task, sum(completed)::bigint AS completed, sum(retried)::bigint AS retried,
       sum(dead)::bigint AS dead,
       ARRAY[coalesce(sum(wait_hist[1]), 0), coalesce(sum(wait_hist[2]), 0),
             coalesce(sum(wait_hist[3]), 0), coalesce(sum(wait_hist[4]), 0),
             coalesce(sum(wait_hist[5]), 0), coalesce(sum(wait_hist[6]), 0),
             coalesce(sum(wait_hist[7]), 0), coalesce(sum(wait_hist[8]), 0),
             coalesce(sum(wait_hist[9]), 0), coalesce(sum(wait_hist[10]), 0),
             coalesce(sum(wait_hist[11]), 0), coalesce(sum(wait_hist[12]), 0),
             coalesce(sum(wait_hist[13]), 0), coalesce(sum(wait_hist[14]), 0),
             coalesce(sum(wait_hist[15]), 0), coalesce(sum(wait_hist[16]), 0),
             coalesce(sum(wait_hist[17]), 0)]::bigint[] AS wait,
       ARRAY[coalesce(sum(run_hist[1]), 0), coalesce(sum(run_hist[2]), 0),
             coalesce(sum(run_hist[3]), 0), coalesce(sum(run_hist[4]), 0),
             coalesce(sum(run_hist[5]), 0), coalesce(sum(run_hist[6]), 0),
             coalesce(sum(run_hist[7]), 0), coalesce(sum(run_hist[8]), 0),
             coalesce(sum(run_hist[9]), 0), coalesce(sum(run_hist[10]), 0),
             coalesce(sum(run_hist[11]), 0), coalesce(sum(run_hist[12]), 0),
             coalesce(sum(run_hist[13]), 0), coalesce(sum(run_hist[14]), 0),
             coalesce(sum(run_hist[15]), 0), coalesce(sum(run_hist[16]), 0),
             coalesce(sum(run_hist[17]), 0)]::bigint[] AS run
FROM "aioq".stats_rollup
WHERE minute > now() - make_interval(secs => $1::float8 + 1800)
GROUP BY queue, task
ORDER BY queue, task
