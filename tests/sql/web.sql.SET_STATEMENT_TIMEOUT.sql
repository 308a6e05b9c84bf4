-- aioq.web.sql.SET_STATEMENT_TIMEOUT, rendered for the schema 'aioq' (make sql-golden writes it)
-- parameters: $1 :timeout
SELECT set_config('statement_timeout', $1, true)
