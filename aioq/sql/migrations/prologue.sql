-- Runs before the migrations (the NNN_name.sql files beside it) every time `aioq schema apply`
-- or `aioq.install()` runs, in the same transaction and under the same advisory lock, so it
-- must be idempotent: the schema, and the table that records which migrations were applied.
-- The schema name placeholder, as in every file here, is replaced by the quoted schema name.

CREATE SCHEMA IF NOT EXISTS @schema;

CREATE TABLE IF NOT EXISTS @schema.migrations (
    version integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);
