-- aioq.sql.schema.INSTALLED_VERSION, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT coalesce(max(version), 0) FROM "aioq".migrations
