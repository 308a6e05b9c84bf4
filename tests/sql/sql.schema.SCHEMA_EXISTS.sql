-- aioq.sql.schema.SCHEMA_EXISTS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :table
SELECT to_regclass($1) IS NOT NULL
