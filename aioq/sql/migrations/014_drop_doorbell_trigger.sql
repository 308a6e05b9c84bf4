-- The doorbell off the insert's hot path (docs/architecture.md, "The doorbell"): aioq's own
-- statements ring (a `rang` CTE in every statement that makes a job claimable), so the insert
-- trigger goes; its statement trigger, transition table and query cost about a quarter of an
-- insert's server CPU. The lock protocol changes with it: a worker on duty for a queue holds
-- the queue's key (the jobs table's oid, hashtext(queue)) exclusively, and a statement tries
-- it shared for its transaction (never waiting on, nor ringing, another inserter). Rows that
-- other programs insert with raw SQL ring through aioq.ring(), or the opt-in trigger
-- (aioq/sql/ring_trigger.sql, `aioq schema apply --ring-trigger`); without either, polling
-- finds them.
DROP TRIGGER IF EXISTS jobs_doorbell ON @schema.jobs;
DROP FUNCTION IF EXISTS @schema.ring_doorbell();
