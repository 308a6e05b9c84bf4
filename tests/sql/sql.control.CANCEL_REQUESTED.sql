-- aioq.sql.control.CANCEL_REQUESTED, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :ids, $2 :claims, $3 :worker
SELECT j.id FROM unnest($1::bigint[], $2::integer[]) AS f(id, claim)
CROSS JOIN LATERAL (
    -- By primary key whatever the statistics say; OFFSET 0 keeps the fence's status test
    -- out of this lookup (it would pick the running rows' index).
    SELECT j.id, j.claims, j.locked_by, j.status, j.cancel_requested_at FROM "aioq".jobs AS j
    WHERE j.id = f.id
    OFFSET 0
) AS j
WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running' AND j.cancel_requested_at IS NOT NULL
