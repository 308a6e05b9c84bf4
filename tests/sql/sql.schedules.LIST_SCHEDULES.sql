-- aioq.sql.schedules.LIST_SCHEDULES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT name, task, queue, spec, CASE WHEN ticked THEN last_tick END AS last_tick, next_tick,
       updated_at
FROM "aioq".schedules
ORDER BY name
