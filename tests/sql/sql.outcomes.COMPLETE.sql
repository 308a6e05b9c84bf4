-- aioq.sql.outcomes.COMPLETE, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :ids, $2 :claims, $3 :worker
WITH mine AS (
    SELECT j.id
    FROM (SELECT * FROM unnest($1::bigint[], $2::integer[]) AS u(id, claim)
          ORDER BY id) AS f
    CROSS JOIN LATERAL (
        -- By primary key whatever the statistics say; OFFSET 0 keeps the fence's status test
        -- out of this lookup (it would pick the running rows' index).
        SELECT j.id, j.claims, j.locked_by, j.status, j.cancel_requested_at FROM "aioq".jobs AS j
        WHERE j.id = f.id
        OFFSET 0
        FOR UPDATE
    ) AS j
    WHERE j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
)
DELETE FROM "aioq".jobs AS j
WHERE j.id = ANY(ARRAY(SELECT id FROM mine))
RETURNING j.id, j.claims
