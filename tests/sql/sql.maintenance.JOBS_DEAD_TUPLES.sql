-- aioq.sql.maintenance.JOBS_DEAD_TUPLES, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: none
SELECT coalesce(s.n_dead_tup, 0) AS dead, pg_has_role(c.relowner, 'USAGE') AS owner,
       c.reltuples::float8 AS reltuples, c.relpages AS relpages,
       coalesce(s.n_live_tup, 0) AS live,
       (pg_relation_size(c.oid) / current_setting('block_size')::integer)::integer AS pages
FROM pg_class AS c
LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE c.oid = '"aioq".jobs'::regclass
