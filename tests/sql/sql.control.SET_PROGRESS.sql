-- aioq.sql.control.SET_PROGRESS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :id, $2 :claim, $3 :worker, $4 :progress, $5 :note (the fields of aioq.sql.control.SetProgress)
UPDATE "aioq".jobs AS j
SET progress = $4, progress_note = $5
FROM (SELECT $1::bigint AS id, $2::integer AS claim) AS f
WHERE j.id = f.id AND j.claims = f.claim AND j.locked_by = $3 AND j.status = 'running'
RETURNING j.id
