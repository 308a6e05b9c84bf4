-- aioq.sql.admin.ARCHIVE_STATS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT a.queue, count(*) FILTER (WHERE a.finished_at > now() - interval '1 minute') AS completed
FROM "aioq".archive AS a
WHERE EXISTS (SELECT FROM "aioq".archive)
GROUP BY a.queue
