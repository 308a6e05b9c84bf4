-- Periodic jobs. One row per schedule: the latest tick enqueued. A tick's job is inserted in
-- the same statement that advances last_tick, conditioned on last_tick being older, so each
-- tick is enqueued once whatever the number of workers, even after its job left the table.

CREATE TABLE @schema.schedules (
    name text PRIMARY KEY,
    task text NOT NULL,
    queue text NOT NULL,
    spec text NOT NULL,               -- "every 60s" or "cron */5 * * * * Europe/Paris"
    last_tick timestamptz NOT NULL,   -- the latest tick enqueued (or skipped at first sight)
    next_tick timestamptz,            -- the tick after it, as the last writer computed it
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The tick a periodic job was enqueued for (NULL for other jobs); the task reads it from
-- aioq.current_job().scheduled_at.
ALTER TABLE @schema.jobs ADD COLUMN scheduled_at timestamptz;
