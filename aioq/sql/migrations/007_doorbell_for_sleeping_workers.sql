-- The doorbell rings only for a queue some worker sleeps on (docs/architecture.md, "The doorbell"): PostgreSQL
-- takes one lock for the whole notification queue at the commit of every transaction that
-- called NOTIFY, so a NOTIFY per insert serializes the commits of every deferring connection.
-- A worker about to sleep holds a shared session advisory lock (the jobs table's oid,
-- hashtext(queue)) on its LISTEN connection, and releases it when rung. A statement rings a
-- queue only when an exclusive try of that lock fails (taken, it is released at once): two
-- lock-table calls per queue and statement, about what the NOTIFY cost. The lock goes with the
-- session, so a killed worker stops the ringing. Polling stays the guarantee.
CREATE OR REPLACE FUNCTION @schema.ring_doorbell() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE run_at <= now()) AS q
    WHERE NOT (
        pg_try_advisory_lock(TG_RELID::int, hashtext(q.queue))
        AND pg_advisory_unlock(TG_RELID::int, hashtext(q.queue))
    );
    RETURN NULL;
END;
$$;
