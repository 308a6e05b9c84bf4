-- aioq.sql.schema.LOCK_SCHEMA, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :key
SELECT pg_advisory_xact_lock(hashtext($1))
