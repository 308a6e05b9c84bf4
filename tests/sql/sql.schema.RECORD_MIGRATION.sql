-- aioq.sql.schema.RECORD_MIGRATION, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :version
INSERT INTO "aioq".migrations (version) VALUES ($1)
