-- Job arguments (jsonb, often kilobytes) are TOASTed and compressed past about 2 KB; lz4
-- compresses a 64 KB argument in a third of pglz's time and decompresses it several times
-- faster, for the claim. A server built without lz4 (or older than PostgreSQL 14) keeps pglz.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE @schema.jobs ALTER COLUMN args SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR syntax_error THEN
    NULL;
END
$$;
