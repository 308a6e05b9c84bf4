-- aioq.sql.admin.ARCHIVE_IN_USE, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT EXISTS (SELECT FROM "aioq".archive)
