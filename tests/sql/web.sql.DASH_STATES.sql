-- aioq.web.sql.DASH_STATES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :cap
SELECT queue, state, count(*) AS n FROM (
    (SELECT queue, 'running' AS state FROM "aioq".jobs WHERE status = 'running' LIMIT $1)
    UNION ALL
    (SELECT queue, 'waiting' FROM "aioq".jobs
     WHERE workflow_id IS NOT NULL AND status = 'waiting' LIMIT $1)
    UNION ALL
    (SELECT queue, 'expired' FROM "aioq".jobs
     WHERE status = 'running' AND lease_expires_at < now() LIMIT $1)
    UNION ALL
    (SELECT queue, 'dead' FROM "aioq".jobs WHERE status = 'dead' LIMIT $1)
    UNION ALL
    (SELECT queue, 'cancelled' FROM "aioq".jobs WHERE status = 'cancelled' LIMIT $1)
) AS s
GROUP BY queue, state
