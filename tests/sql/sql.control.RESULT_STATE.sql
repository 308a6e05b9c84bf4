-- aioq.sql.control.RESULT_STATE, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :id
SELECT status, last_error, NULL::text AS result, false AS expired,
       CASE WHEN t.top IS NULL OR w.after >= 2147483648 THEN false
            WHEN t.top + w.after >= txid_snapshot_xmax(txid_current_snapshot()) THEN true
            ELSE coalesce(txid_status(t.top + w.after) = 'in progress', false)
       END AS uncommitted
FROM "aioq".jobs AS j,
     LATERAL (SELECT txid_current_if_assigned() AS top) AS t,
     LATERAL (SELECT (j.xmin::text::bigint - t.top % 4294967296 + 4294967296) % 4294967296
              AS after) AS w
WHERE j.id = $1
UNION ALL
SELECT 'succeeded', NULL, result::text, expires_at <= now(), false FROM "aioq".results
WHERE id = $1
LIMIT 1
