-- aioq.sql.schedules.SCHEDULE_STATE, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :names
SELECT clock_timestamp() AS now, n.name, s.last_tick
FROM unnest($1::text[]) AS n(name)
LEFT JOIN "aioq".schedules AS s ON s.name = n.name
