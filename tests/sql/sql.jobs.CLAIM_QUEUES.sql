-- aioq.sql.jobs.CLAIM_QUEUES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :queues, $2 :limit, $3 :worker, $4 :unknown, $5 :grace (the fields of aioq.sql.jobs.ClaimQueues)
WITH picked AS (
    SELECT p.id FROM unnest($1::text[]) AS q(queue)
    CROSS JOIN LATERAL (
        SELECT id, priority, run_at FROM "aioq".jobs
        WHERE queue = q.queue AND status = 'pending' AND run_at <= now() AND (unknown_since IS NULL OR task <> ALL($4::text[])
             OR unknown_since <= now() - make_interval(secs => $5::float8))
        ORDER BY priority DESC, run_at, id
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ) AS p
    ORDER BY priority DESC, run_at, id
    LIMIT $2
)
UPDATE "aioq".jobs AS j
SET status = 'running', attempts = j.attempts + 1, claims = j.claims + 1, locked_by = $3,
    locked_at = now(), lease_expires_at = now() + j.lease
WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING j.id, j.claims, j.queue, j.task, j.args::text AS args, j.priority, j.attempts,
          j.max_attempts, j.snoozes, extract(epoch FROM j.lease)::float8 AS lease,
          extract(epoch FROM j.locked_at - j.run_at)::float8 AS waited, j.traceparent,
          j.scheduled_at, j.workflow_id,
          extract(epoch FROM now() - j.unknown_since)::float8 AS unknown_for
