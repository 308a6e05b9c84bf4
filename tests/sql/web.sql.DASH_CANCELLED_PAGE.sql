-- aioq.web.sql.DASH_CANCELLED_PAGE, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :before, $2 :window, $3 :status, $4 :queue, $5 :task, $6 :text, $7 :limit (the fields of aioq.web.sql.DashPage)
WITH win AS MATERIALIZED (
    SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, locked_by,
           last_error, created_at, progress
    FROM "aioq".jobs
    WHERE status = 'cancelled' AND id < coalesce($1::bigint, 9223372036854775807)
    ORDER BY id DESC
    LIMIT $2
)
SELECT w.floor, w.scanned, m.*
FROM (SELECT min(id) AS floor, count(*) AS scanned FROM win) AS w
LEFT JOIN LATERAL (
    SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, locked_by,
           left(last_error, 300) AS error, created_at, progress
    FROM win
    WHERE ($3::text IS NULL OR status = $3)
      AND ($4::text IS NULL OR queue = $4)
      AND ($5::text IS NULL OR task = $5)
      AND ($6::text IS NULL OR strpos(lower(last_error), lower($6)) > 0)
    ORDER BY id DESC
    LIMIT $7
) AS m ON true
ORDER BY m.id DESC
