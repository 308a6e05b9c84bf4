-- aioq.sql.schedules.SCHEDULE_START, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :name, $2 :task, $3 :queue, $4 :spec, $5 :last_tick, $6 :next_tick (the fields of aioq.sql.schedules.ScheduleStart)
INSERT INTO "aioq".schedules (name, task, queue, spec, last_tick, next_tick, ticked)
VALUES ($1, $2, $3, $4, $5, $6, false)
ON CONFLICT (name) DO NOTHING
RETURNING name
