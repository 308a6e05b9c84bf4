-- The W3C traceparent of the span that deferred the job (aioq.contrib.otel), NULL when no
-- tracer was recording: the worker's span for the run continues that trace.
ALTER TABLE @schema.jobs ADD COLUMN traceparent text;
