"""The pieces of SQL that several statements share, each written once, included by name.

``@fence`` in a statement's template is :data:`FENCE` here, included as written (aioq.sql's
docstring gives the template rules; a fragment may include others). A fragment names the
parameters and table aliases it uses; the statements that include it declare those
parameters and give those aliases. tests/sql/ holds every statement as it is sent, fragments
included.
"""

from __future__ import annotations

# --- the claim (docs/architecture.md, "The claim") ---

READY = "status = 'pending' AND run_at <= now()"
"""A job ready to run now (of the queue the statement names beside it, ``queue = ...``).
With that equality on the leading column, exactly the partial index jobs_claim_idx: its
predicate is the status test, and ``run_at`` a key column (tests/test_sql.py holds the two
together)."""

CLAIM_ORDER = "priority DESC, run_at, id"
"""The order jobs are claimed in: priority (higher first), then run_at, then id; the key of
jobs_claim_idx after the queue, so a claim reads the index in this order and sorts nothing."""

CLAIM = "status = 'running', attempts = j.attempts + 1, claims = j.claims + 1, locked_by = :worker"
"""The claim itself (``UPDATE jobs AS j SET @claim, ...``): the job runs, for worker
``:worker``, one attempt more, and the claim counter moves (the claim's identity,
docs/architecture.md "The fence"). The statement sets the lease (``locked_at``,
``lease_expires_at``) from its own clock."""

CLAIMED_COLUMNS = """j.id, j.claims, j.queue, j.task, j.args::text AS args, j.priority, j.attempts,
          j.max_attempts, j.snoozes, extract(epoch FROM j.lease)::float8 AS lease,
          extract(epoch FROM j.locked_at - j.run_at)::float8 AS waited, j.traceparent,
          j.scheduled_at, j.workflow_id,
          extract(epoch FROM now() - j.unknown_since)::float8 AS unknown_for"""
"""What a claim returns (``RETURNING @claimed_columns``), as Claim.from_row reads it."""

KNOWN = """(unknown_since IS NULL OR task <> ALL(:unknown::text[])
     OR unknown_since <= now() - make_interval(secs => :grace::float8))"""
"""A ready job this worker may claim: not one that waits for a worker that knows its task
when this worker found it does not (``:unknown``, the names of the tasks it does not know),
unless it has waited ``:grace`` seconds (this worker's unknown_task_grace: then the claim takes
it to make it dead). docs/architecture.md, "Unknown tasks". With no name in ``:unknown``, the
first test is all a job costs."""

# --- the fence (docs/architecture.md, "The fence") ---

FENCE = "j.claims = f.claim AND j.locked_by = :worker AND j.status = 'running'"
"""Row ``j`` is still held by claim ``f.claim`` of worker ``:worker``."""

BY_ID = """-- By primary key whatever the statistics say; OFFSET 0 keeps the fence's status test
-- out of this lookup (it would pick the running rows' index).
SELECT j.id, j.claims, j.locked_by, j.status, j.cancel_requested_at FROM @schema.jobs AS j
WHERE j.id = f.id
OFFSET 0"""
"""Row ``j`` of each ``f.id``, with the columns the fence tests, inside ``CROSS JOIN LATERAL
(...) AS j`` (with ``FOR UPDATE`` after it, the row is locked as it is found). A join left to
the planner walked the running rows and rescanned the id arrays for each when the last ANALYZE
saw none running (a quiet queue before a burst): time in running rows x batch, a second per
batch at concurrency 1 000."""

MINE = """mine AS (
    SELECT j.id
    FROM (SELECT * FROM unnest(:ids::bigint[], :claims::integer[]) AS u(id, claim)
          ORDER BY id) AS f
    CROSS JOIN LATERAL (
        @by_id
        FOR UPDATE
    ) AS j
    WHERE @fence
)"""
"""The ``mine`` CTE of a fenced write: the rows of ``:ids`` still held by their claims
(``:claims``, the claim numbers) under the fence, locked in id order, so that the fenced writes
never wait on each other in opposite orders (a deadlock)."""

HELD = "j.id = ANY(ARRAY(SELECT id FROM mine))"
"""Row ``j`` is one of the rows the ``mine`` CTE locked (their ids read once into an array),
looked up in the primary key whatever the statistics say: the write of a fenced statement
(``DELETE ... WHERE @held``). Not a join with ``mine``: a VACUUM that found the table empty (a
queue that keeps up) records no live row over the pages it kept, the planner then prices the
whole table at one row however large it grows, and a join was planned as a walk of the whole
primary key with ``mine`` rescanned for each row: a batch took longer the longer the backlog,
seconds at 350 000 jobs, and the worker stopped (docs/architecture.md, "The fence")."""

CLEAR_CLAIM = """last_worker = j.locked_by, locked_by = NULL, locked_at = NULL,
lease_expires_at = NULL"""
"""The columns that end a claim without deleting the row (retried, snoozed, released, dead,
cancelled, rescued); ``last_worker`` keeps where it last ran."""

PENDING_UNLESS_CANCEL_REQUESTED = (
    "CASE WHEN j.cancel_requested_at IS NULL THEN 'pending' ELSE 'cancelled' END"
)
"""The status of a job that leaves ``running`` for another run (retried, snoozed, released):
pending, unless a cancel was requested; then it is cancelled and never runs again
(docs/architecture.md, "Job states")."""

# The outcomes of a batch of attempts (WRITE_OUTCOMES, WRITE_STEP_OUTCOMES; what each kind does:
# aioq.sql.outcomes). `done` deletes the succeeded rows; `succeeded` reads them as the
# statement's snapshot has them (sibling CTEs do not see each other's changes): the rows `mine`
# locked and `done` deletes. Reading them there rather than from `done`'s RETURNING keeps a
# plain completion from copying every row's arguments. `changed` writes the others; `told`
# rings the results channel for every awaited job that ended (succeeded, dead or cancelled).
# No join of the table with the batch is left to the planner (see HELD): `done` and `changed`
# find their rows by id, `succeeded` looks each row up by id in a lateral subquery, and
# `changed` finds each row's outcome by key in `outcomes`, one jsonb object built once. (A join
# on the locked rows' ctid lost writes: a heartbeat that updated a held row after the
# statement's snapshot left the newer version invisible to it.)
OUTCOME_WRITES = """mine AS (
    SELECT j.id, f.kind, f.delay, f.error, f.result, f.ttl
    FROM (SELECT * FROM unnest(:ids::bigint[], :claims::integer[], :kinds::text[],
                               :delays::float8[], :errors::text[], :results::text[],
                               :ttls::float8[])
          AS u(id, claim, kind, delay, error, result, ttl) ORDER BY id) AS f
    CROSS JOIN LATERAL (
        @by_id
        FOR UPDATE
    ) AS j
    WHERE @fence
),
done AS (
    DELETE FROM @schema.jobs AS j
    WHERE j.id = ANY(ARRAY(SELECT id FROM mine WHERE kind = 'succeeded'))
    RETURNING j.id, j.claims AS claim
),
succeeded AS (
    SELECT j.id, j.queue, j.task, j.args, j.priority, j.attempts, j.max_attempts, j.locked_by,
           j.locked_at, j.created_at, j.progress, j.progress_note, m.result, m.ttl
    FROM mine AS m
    CROSS JOIN LATERAL (
        SELECT j.id, j.queue, j.task, j.args, j.priority, j.attempts, j.max_attempts,
               j.locked_by, j.locked_at, j.created_at, j.progress, j.progress_note
        FROM @schema.jobs AS j
        WHERE j.id = m.id
        OFFSET 0
    ) AS j
    WHERE m.kind = 'succeeded' AND (m.ttl IS NOT NULL OR :archive::boolean)
),
kept AS (
    INSERT INTO @schema.results (id, queue, task, args, priority, attempts, max_attempts,
                                 worker, progress, progress_note, created_at, started_at,
                                 finished_at, expires_at, result)
    SELECT id, queue, task, args, priority, attempts, max_attempts, locked_by, progress,
           progress_note, created_at, locked_at, clock_timestamp(),
           clock_timestamp() + make_interval(secs => ttl), result::jsonb
    FROM succeeded WHERE ttl IS NOT NULL
    RETURNING id
),
archived AS (
    INSERT INTO @schema.archive (id, queue, task, args, priority, attempts, max_attempts,
                                 worker, created_at, started_at, finished_at)
    SELECT id, queue, task, args, priority, attempts, max_attempts, locked_by,
           created_at, locked_at, clock_timestamp()
    FROM succeeded WHERE :archive::boolean
),
outcomes AS (
    SELECT coalesce(jsonb_object_agg(id::text, jsonb_build_object(
               'kind', kind, 'delay', delay, 'error', error, 'ttl', ttl)), '{}') AS by_id
    FROM mine
    WHERE kind <> 'succeeded'
),
changed AS (
    UPDATE @schema.jobs AS j
    SET (status, run_at, last_error, attempts, max_attempts, snoozes, cancel_requested_at,
         unknown_since) = (
        SELECT CASE m.kind WHEN 'dead' THEN 'dead' WHEN 'cancelled' THEN 'cancelled'
                    ELSE @pending_unless_cancel_requested END,
               now() + make_interval(secs => m.delay),
               CASE WHEN m.kind IN ('retried', 'dead') THEN coalesce(m.error, j.last_error)
                    ELSE j.last_error END,
               j.attempts - CASE WHEN m.kind IN ('released', 'unknown_task') THEN 1 ELSE 0 END,
               j.max_attempts + CASE WHEN m.kind = 'snoozed' THEN 1 ELSE 0 END,
               j.snoozes + CASE WHEN m.kind = 'snoozed' THEN 1 ELSE 0 END,
               CASE WHEN m.kind = 'cancelled' THEN coalesce(j.cancel_requested_at, now())
                    ELSE j.cancel_requested_at END,
               CASE m.kind WHEN 'unknown_task' THEN coalesce(j.unknown_since, now())
                           WHEN 'released' THEN j.unknown_since END
        FROM jsonb_to_record(o.by_id -> j.id::text)
             AS m(kind text, delay float8, error text, ttl float8)
    ),
        @clear_claim
    FROM outcomes AS o
    WHERE j.id = ANY(ARRAY(SELECT id FROM mine WHERE kind <> 'succeeded'))
    RETURNING j.id, j.claims AS claim, j.queue, j.status,
              (o.by_id -> j.id::text ->> 'delay')::float8 AS delay,
              o.by_id -> j.id::text ->> 'ttl' IS NOT NULL AS awaited
),
told AS (
    SELECT pg_notify(:results_channel, id::text) FROM kept
    UNION ALL
    SELECT pg_notify(:results_channel, id::text) FROM changed
    WHERE awaited AND status <> 'pending'
)"""

# --- the doorbell (docs/architecture.md, "The doorbell"; aioq.sql.doorbell) ---

DUTY = "'@schema.jobs'::regclass::oid::bigint"
"""The seed of a duty key: ``hashtextextended(name, @duty)`` is the duty key of a queue, and of
the empty name (no queue has it) the key of "any queue", the wildcard. A worker on duty holds
its key exclusively; a statement that makes jobs claimable tries it shared."""

STANDBY = "~'@schema.jobs'::regclass::oid::bigint"
"""The seed of a standby key (``hashtextextended(name, @standby)``): every sleeping worker of a
queue (or of the wildcard) holds it shared."""

RINGS = """CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended(r.queue, @duty))
      THEN NOT (pg_try_advisory_lock_shared(hashtextextended('', @duty))
                AND pg_advisory_unlock_shared(hashtextextended('', @duty)))
      ELSE true END"""
"""Whether a statement that makes jobs of queue ``r.queue`` claimable rings it: true when a
worker is on duty for the queue (the shared try of its key fails); else the statement holds
that key until its transaction ends ("an insert in flight"), and rings when a worker is on duty
for any queue (the wildcard's key is held: tried and released at once, never held). CASE keeps
the order: the wildcard is tested only after the queue's key is held."""

RANG = """rang AS (
    SELECT pg_notify(@doorbell, r.queue) FROM (SELECT queue FROM ready_queues OFFSET 0) AS r
    WHERE @rings
)"""
"""The ``rang`` CTE of a statement that makes jobs claimable: a NOTIFY (sent at commit) for each
queue of its ``ready_queues(queue)`` CTE (the distinct queues whose jobs are claimable now)
that :data:`RINGS`. A queue it does not ring it holds the key of until its transaction ends
("an insert in flight"), and a worker cannot go on duty until then, so only queues with jobs
claimable now may be tried. OFFSET 0 keeps ``ready_queues``' own conditions before the try.
PostgreSQL runs a CTE that is not data-modifying only if the statement reads it: every
statement that includes this one reads it with ``WHERE (SELECT count(*) FROM rang) >= 0``,
always true."""

# --- defer (docs/architecture.md, "Transactional defer") ---

RUN_AT = "coalesce(:run_at::timestamptz, now() + make_interval(secs => :delay::float8))"
"""When a deferred job runs: at ``:run_at``, or (NULL) ``:delay`` seconds from now."""

# --- inspection (aioq.sql.admin) ---

JOB_COLUMNS = """id, queue, task, args::text AS args, status, priority, run_at, attempts,
       max_attempts, extract(epoch FROM lease)::float8 AS lease, locked_by, locked_at,
       lease_expires_at, last_error, unique_key, created_at, cancel_requested_at, progress,
       progress_note, NULL::text AS result, last_worker, workflow_id, unknown_since"""
"""A jobs row as Job.from_row reads it (GET_JOB, LIST_JOBS)."""

ARCHIVED_JOB = """SELECT id, queue, task, args::text AS args, 'succeeded' AS status, priority,
       started_at AS run_at, attempts, max_attempts, NULL::float8 AS lease,
       worker AS locked_by, started_at AS locked_at, NULL::timestamptz AS lease_expires_at,
       NULL::text AS last_error, NULL::text AS unique_key, created_at, finished_at,
       worker AS last_worker
FROM @schema.archive"""
"""Finished jobs in the archive, shaped as GET_JOB's rows, status 'succeeded'. The archive keeps
no run_at, lease, error or unique_key: run_at and locked_at are when the successful attempt
started."""

# --- limits (aioq.sql.limits) ---

QUEUE_LIMITED = """(max_running IS NOT NULL OR rate_limit IS NOT NULL OR paused
     OR max_running_per_key IS NOT NULL)"""
"""A queues row with a limit, or paused: its jobs are claimed by CLAIM_LIMITED."""

# --- the outcome history (aioq.sql.history, the dashboard) ---

ROLLUP_STEP = "1800"
"""The period of a stats_rollup row in seconds (aioq.sql.history.ROLLUP_STEP reads it)."""

BIN_ORIGIN = "timestamptz '2000-01-01'"
"""Where the rollup's bins start: a step that is a multiple of ROLLUP_STEP bins them whole."""

ADD_COUNTS = """SET completed = h.completed + excluded.completed,
    retried = h.retried + excluded.retried,
    dead = h.dead + excluded.dead,
    wait_hist = (SELECT array_agg(a + b ORDER BY i)
                 FROM unnest(h.wait_hist, excluded.wait_hist) WITH ORDINALITY AS x(a, b, i)),
    run_hist = (SELECT array_agg(a + b ORDER BY i)
                FROM unnest(h.run_hist, excluded.run_hist) WITH ORDINALITY AS x(a, b, i))"""
"""Add the new counts and histograms (``excluded``) to a history row (``h``), bucket by bucket."""

# The histograms summed bucket by bucket over the rows read: plain aggregates, no unnest of
# every row's arrays. One term per bucket of aioq.stats_history.BUCKETS (HIST_WIDTH of them).
WAIT_HIST_SUMS = """ARRAY[coalesce(sum(wait_hist[1]), 0), coalesce(sum(wait_hist[2]), 0),
      coalesce(sum(wait_hist[3]), 0), coalesce(sum(wait_hist[4]), 0),
      coalesce(sum(wait_hist[5]), 0), coalesce(sum(wait_hist[6]), 0),
      coalesce(sum(wait_hist[7]), 0), coalesce(sum(wait_hist[8]), 0),
      coalesce(sum(wait_hist[9]), 0), coalesce(sum(wait_hist[10]), 0),
      coalesce(sum(wait_hist[11]), 0), coalesce(sum(wait_hist[12]), 0),
      coalesce(sum(wait_hist[13]), 0), coalesce(sum(wait_hist[14]), 0),
      coalesce(sum(wait_hist[15]), 0), coalesce(sum(wait_hist[16]), 0),
      coalesce(sum(wait_hist[17]), 0)]::bigint[]"""

RUN_HIST_SUMS = """ARRAY[coalesce(sum(run_hist[1]), 0), coalesce(sum(run_hist[2]), 0),
      coalesce(sum(run_hist[3]), 0), coalesce(sum(run_hist[4]), 0),
      coalesce(sum(run_hist[5]), 0), coalesce(sum(run_hist[6]), 0),
      coalesce(sum(run_hist[7]), 0), coalesce(sum(run_hist[8]), 0),
      coalesce(sum(run_hist[9]), 0), coalesce(sum(run_hist[10]), 0),
      coalesce(sum(run_hist[11]), 0), coalesce(sum(run_hist[12]), 0),
      coalesce(sum(run_hist[13]), 0), coalesce(sum(run_hist[14]), 0),
      coalesce(sum(run_hist[15]), 0), coalesce(sum(run_hist[16]), 0),
      coalesce(sum(run_hist[17]), 0)]::bigint[]"""

# --- the dashboard's reads (aioq/web/sql.py) ---

PAGE_MATCHES = """SELECT w.floor, w.scanned, m.*
FROM (SELECT min(id) AS floor, count(*) AS scanned FROM win) AS w
LEFT JOIN LATERAL (
    SELECT id, queue, task, status, priority, run_at, attempts, max_attempts, locked_by,
           left(last_error, 300) AS error, created_at, progress
    FROM win
    WHERE (:status::text IS NULL OR status = :status)
      AND (:queue::text IS NULL OR queue = :queue)
      AND (:task::text IS NULL OR task = :task)
      AND (:text::text IS NULL OR strpos(lower(last_error), lower(:text)) > 0)
    ORDER BY id DESC
    LIMIT :limit
) AS m ON true
ORDER BY m.id DESC"""
"""A page of the jobs a ``win`` CTE read (DASH_PAGE and its kin): the window's floor and size,
and its jobs that match the filters, at most ``:limit``; always one row."""
