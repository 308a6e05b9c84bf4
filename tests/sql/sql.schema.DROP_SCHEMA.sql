-- aioq.sql.schema.DROP_SCHEMA, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
DROP SCHEMA IF EXISTS "aioq" CASCADE
