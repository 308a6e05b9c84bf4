-- The opt-in doorbell trigger for jobs inserted with raw SQL (docs/architecture.md, "The
-- doorbell"): not part of the schema unless asked for (`aioq schema apply --ring-trigger`,
-- `aioq.install(conn, ring_trigger=True)`). aioq's own statements ring without it. It rings a
-- queue as they do: when the shared try of the queue's duty key fails (a worker is on duty),
-- else holding that key until the transaction ends (an insert in flight) and ringing when the
-- shared try of the wildcard's key (tried and released at once) fails (a worker is on duty for
-- any queue). Only jobs that are claimable now ring: not a delayed job, nor a workflow step
-- waiting for its dependencies.
CREATE OR REPLACE FUNCTION @schema.ring_doorbell() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs
          WHERE run_at <= now() AND status = 'pending' OFFSET 0) AS q
    WHERE CASE WHEN pg_try_advisory_xact_lock_shared(@schema.doorbell_key(q.queue))
               THEN NOT (pg_try_advisory_lock_shared(@schema.doorbell_key(''))
                         AND pg_advisory_unlock_shared(@schema.doorbell_key('')))
               ELSE true END;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS jobs_doorbell ON @schema.jobs;
CREATE TRIGGER jobs_doorbell
    AFTER INSERT ON @schema.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION @schema.ring_doorbell();
