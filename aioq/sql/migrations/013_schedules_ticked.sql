-- Whether a schedule's last_tick was enqueued: at first sight a worker records the latest past
-- tick as done without enqueuing it, and `aioq schedules` shows such a schedule's last tick as
-- never. Rows from before this column may have ticked: they keep showing their last tick.
ALTER TABLE @schema.schedules ADD COLUMN ticked boolean NOT NULL DEFAULT true;
ALTER TABLE @schema.schedules ALTER COLUMN ticked SET DEFAULT false;
