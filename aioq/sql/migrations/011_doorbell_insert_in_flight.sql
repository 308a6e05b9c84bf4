-- The doorbell without a lost wake-up (docs/architecture.md, "The doorbell"). Migration 7 left one: a
-- transaction that inserted while nobody slept (so it did not ring) and committed after a
-- worker armed and looked once more (its row not yet visible) waited for the next poll. Now a
-- statement that could ring also holds, until its transaction ends, a shared transaction-level
-- advisory lock (~the jobs table's oid, hashtext(queue)): "an insert is in flight". A worker
-- arming tries that key exclusively after taking its doorbell lock; when it fails, an insert
-- that may not have rung is uncommitted, and the worker looks again shortly instead of
-- sleeping (aioq.producer.Producer.wait). Inserters share the key, so they never wait on each
-- other; a failed try means a worker is testing the key right now, with its doorbell lock
-- already held, so the statement rings. One more lock-table call per queue and statement, and
-- its release at commit.
CREATE OR REPLACE FUNCTION @schema.ring_doorbell() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('aioq:' || TG_TABLE_SCHEMA, q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE run_at <= now()) AS q
    WHERE NOT (
        pg_try_advisory_xact_lock_shared(~TG_RELID::int, hashtext(q.queue))
        AND pg_try_advisory_lock(TG_RELID::int, hashtext(q.queue))
        AND pg_advisory_unlock(TG_RELID::int, hashtext(q.queue))
    );
    RETURN NULL;
END;
$$;
