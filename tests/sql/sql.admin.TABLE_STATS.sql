-- aioq.sql.admin.TABLE_STATS, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT pg_table_size(c.oid) AS table_bytes, pg_indexes_size(c.oid) AS index_bytes,
       s.n_live_tup, s.n_dead_tup, s.last_autovacuum, s.last_vacuum, s.last_autoanalyze
FROM pg_class AS c
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE c.oid = '"aioq".jobs'::regclass
