"""One method per statement of :mod:`aioq.queries`, for one schema."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime

import asyncpg

from aioq import queries as q
from aioq.db import Connection, Executor, Target, executor
from aioq.job import Claim, Job

__all__ = ("Connection", "Executor", "Store", "Target", "executor")

TABLE_DEFAULTS = (0, 5, 30.0)
"""The column defaults of jobs.priority, max_attempts and lease (seconds) in schema.sql."""

VACUUM_TIMEOUT = 3600.0
"""Seconds a VACUUM of the jobs table may take before it is cancelled."""


class Store:
    """The statements of one schema, rendered once."""

    def __init__(self, schema: str = q.DEFAULT_SCHEMA) -> None:
        self.schema = schema
        self.channel = q.channel_name(schema)
        render = functools.partial(q.render, schema=schema)
        self._insert = render(q.INSERT_JOB)
        self._insert_default = render(q.INSERT_DEFAULT_JOB)
        self._insert_unique = render(q.INSERT_UNIQUE_JOB)
        self._insert_many = render(q.INSERT_JOBS)
        self._claim_one = render(q.CLAIM_ONE_QUEUE)
        self._claim_many = render(q.CLAIM_QUEUES)
        self._complete = render(q.COMPLETE)
        self._complete_archived = render(q.COMPLETE_ARCHIVED)
        self._heartbeat = render(q.HEARTBEAT)
        self._reschedule = render(q.RESCHEDULE)
        self._bury = render(q.BURY)
        self._release_worker = render(q.RELEASE_WORKER)
        self._reap = render(q.REAP)
        self._replay = render(q.REPLAY_DEAD)
        self._get = render(q.GET_JOB)
        self._list_jobs = render(q.LIST_JOBS)
        self._prune_archive = render(q.PRUNE_ARCHIVE)
        self._prune_ended = render(q.PRUNE_ENDED)
        self._queue_stats = render(q.QUEUE_STATS)
        self._archive_stats = render(q.ARCHIVE_STATS)
        self._table_stats = render(q.TABLE_STATS)
        # jobcontrol: cancel, progress, results
        self.control_channel = q.control_channel(schema)
        self.results_channel = q.results_channel(schema)
        self._cancel_jobs = render(q.CANCEL_JOBS)
        self._cancel_requested = render(q.CANCEL_REQUESTED)
        self._cancel_running = render(q.CANCEL_RUNNING)
        self._ring_results = render(q.RING_RESULTS)
        self._complete_result = render(q.COMPLETE_RESULT)
        self._set_progress = render(q.SET_PROGRESS)
        self._result_state = render(q.RESULT_STATE)
        self._prune_results = render(q.PRUNE_RESULTS)
        self._list_results = render(q.LIST_RESULT_JOBS)
        self._jobs_dead_tuples = render(q.JOBS_DEAD_TUPLES)
        self._vacuum_jobs = render(q.VACUUM_JOBS)
        self._record_stats = render(q.RECORD_STATS)
        self._prune_stats = render(q.PRUNE_STATS)
        self._forget_worker = render(q.FORGET_WORKER)
        self._recent_outcomes = render(q.RECENT_OUTCOMES)
        self._delete = render(q.DELETE_JOBS)
        self._ready_queues = render(q.READY_QUEUES)
        self._waiting = render(q.WAITING_JOBS)
        # periodic jobs
        self._schedule_state = render(q.SCHEDULE_STATE)
        self._schedule_start = render(q.SCHEDULE_START)
        self._schedule_tick = render(q.SCHEDULE_TICK)
        self._list_schedules = render(q.LIST_SCHEDULES)
        # queue limits
        self._limited_queues = render(q.LIMITED_QUEUES)
        self._lock_queue = render(q.LOCK_QUEUE)
        self._claim_limited = render(q.CLAIM_LIMITED)
        self._set_queue = render(q.SET_QUEUE)
        self._queue_settings = render(q.QUEUE_SETTINGS)
        self._get_archived = render(q.GET_ARCHIVED_JOB)
        self._list_archived = render(q.LIST_ARCHIVED_JOBS)
        self._archive_in_use = render(q.ARCHIVE_IN_USE)
        self._arm_doorbell = render(q.ARM_DOORBELL)
        self._disarm_doorbell = render(q.DISARM_DOORBELL)
        self._inserts_in_flight = render(q.INSERTS_IN_FLIGHT)

    @staticmethod
    @functools.cache
    def for_schema(schema: str) -> Store:
        """Return the shared store of a schema."""
        return Store(schema)

    async def insert(
        self,
        conn: Executor,
        *,
        queue: str,
        task: str,
        args: str,
        priority: int,
        run_at: datetime | None,
        delay: float,
        max_attempts: int,
        lease: float,
        unique_key: str | None,
        traceparent: str | None = None,
    ) -> int | None:
        """Insert one job and return its id (with a unique_key: the live job's id, or None)."""
        values = (queue, task, args, priority, run_at, delay, max_attempts, lease, traceparent)
        if unique_key is None:
            return await conn.fetchval(self._insert, *values)  # type: ignore[no-any-return]
        return await conn.fetchval(self._insert_unique, *values, unique_key)  # type: ignore[no-any-return]

    async def insert_default(self, conn: Executor, *, queue: str, task: str, args: str) -> int:
        """Insert one job whose other columns take the table's defaults; return its id."""
        return await conn.fetchval(self._insert_default, queue, task, args)  # type: ignore[no-any-return]

    async def insert_many(
        self,
        conn: Executor,
        *,
        queue: str,
        task: str,
        args: Sequence[str],
        priority: int,
        run_at: datetime | None,
        delay: float,
        max_attempts: int,
        lease: float,
        traceparent: str | None = None,
    ) -> list[int]:
        """Insert many jobs of one task in one statement and return their ids in order."""
        rows = await conn.fetch(
            self._insert_many,
            *(queue, task, priority, run_at, delay, max_attempts, lease, args, traceparent),
        )
        return [row[0] for row in rows]

    async def claim(
        self, conn: Executor, queues: Sequence[str], limit: int, worker_id: str
    ) -> list[Claim]:
        """Claim up to ``limit`` ready jobs of these queues for ``worker_id``, committed at once."""
        if len(queues) == 1:
            rows = await conn.fetch(self._claim_one, queues[0], limit, worker_id)
        else:
            rows = await conn.fetch(self._claim_many, list(queues), limit, worker_id)
        claims = [Claim.from_row(row) for row in rows]
        claims.sort(key=lambda c: (-c.priority, c.id))
        return claims

    # The fenced writes take the claims' job ids and claim numbers (Claim.key), in two arrays.

    async def complete(
        self,
        conn: Executor,
        ids: Sequence[int],
        numbers: Sequence[int],
        worker_id: str,
        *,
        archive: bool = False,
    ) -> set[int]:
        """Remove finished jobs (or move them to the archive); return the ids still ours."""
        sql = self._complete_archived if archive else self._complete
        rows = await conn.fetch(sql, ids, numbers, worker_id)
        return {row[0] for row in rows}

    async def heartbeat(
        self, conn: Executor, ids: Sequence[int], numbers: Sequence[int], worker_id: str
    ) -> set[int]:
        """Extend the leases of our running jobs; return the ids whose lease we still hold."""
        rows = await conn.fetch(self._heartbeat, ids, numbers, worker_id)
        return {row[0] for row in rows}

    async def reschedule(
        self,
        conn: Executor,
        ids: Sequence[int],
        numbers: Sequence[int],
        worker_id: str,
        *,
        delays: Sequence[float],
        errors: Sequence[str | None],
        refunds: Sequence[bool],
        snoozes: Sequence[bool] | None = None,
    ) -> set[int]:
        """Return our running jobs to pending after their delays; return the ids changed."""
        if snoozes is None:
            snoozes = [False] * len(ids)
        rows = await conn.fetch(
            self._reschedule, ids, numbers, worker_id, delays, errors, refunds, snoozes
        )
        return {row[0] for row in rows}

    async def bury(
        self,
        conn: Executor,
        ids: Sequence[int],
        numbers: Sequence[int],
        worker_id: str,
        *,
        errors: Sequence[str],
    ) -> set[int]:
        """Mark our running jobs dead with their errors; return the ids changed."""
        rows = await conn.fetch(self._bury, ids, numbers, worker_id, errors)
        return {row[0] for row in rows}

    async def release_worker(
        self, conn: Executor, worker_id: str, *, keep: Sequence[int] = ()
    ) -> list[int]:
        """Return every job still running under ``worker_id`` to pending, attempt refunded."""
        rows = await conn.fetch(self._release_worker, worker_id, list(keep))
        return sorted(row[0] for row in rows)

    async def reap(
        self, conn: Executor, limit: int, *, worker_id: str | None = None
    ) -> list[tuple[int, str]]:
        """Return up to ``limit`` expired claims to pending (or dead); return (id, status).

        The claims of ``worker_id`` (the reaping worker) are left alone.
        """
        rows = await conn.fetch(self._reap, limit, worker_id)
        return [(row[0], row[1]) for row in rows]

    async def replay(
        self,
        conn: Executor,
        *,
        ids: Sequence[int] | None = None,
        task: str | None = None,
        queue: str | None = None,
    ) -> Sequence[asyncpg.Record]:
        """Make matching dead jobs pending again with fresh attempts, one per unique_key.

        Return every matching dead job: id, unique_key, replayed, live_id (the live job holding
        its key) and newest (the dead job of its key that was chosen).
        """
        return await conn.fetch(self._replay, list(ids) if ids is not None else None, task, queue)

    async def get(self, conn: Executor, job_id: int) -> Job | None:
        """Return one job, or None if it is not in the table."""
        row = await conn.fetchrow(self._get, job_id)
        return Job.from_row(row) if row is not None else None

    async def get_archived(self, conn: Executor, job_id: int) -> Job | None:
        """Return one finished job from the archive, or None if it is not there."""
        row = await conn.fetchrow(self._get_archived, job_id)
        return Job.from_row(row) if row is not None else None

    async def list_archived(
        self, conn: Executor, *, task: str | None, queue: str | None, limit: int
    ) -> list[Job]:
        """Return finished jobs from the archive matching the filters, oldest first."""
        rows = await conn.fetch(self._list_archived, task, queue, limit)
        return [Job.from_row(row) for row in rows]

    async def archive_in_use(self, conn: Executor) -> bool:
        """Return whether the archive holds any job (some worker keeps finished jobs)."""
        return bool(await conn.fetchval(self._archive_in_use))

    async def list_jobs(
        self,
        conn: Executor,
        *,
        status: str | None = None,
        task: str | None = None,
        queue: str | None = None,
        limit: int = 100,
    ) -> list[Job]:
        """Return jobs matching the filters, oldest first."""
        rows = await conn.fetch(self._list_jobs, status, task, queue, limit)
        return [Job.from_row(row) for row in rows]

    async def prune_archive(self, conn: Executor, older_than: float, limit: int) -> int:
        """Delete up to ``limit`` archived jobs finished over ``older_than`` seconds ago."""
        return await conn.fetchval(self._prune_archive, older_than, limit)  # type: ignore[no-any-return]

    async def prune_dead(self, conn: Executor, older_than: float, limit: int) -> int:
        """Delete up to ``limit`` jobs that died over ``older_than`` seconds ago."""
        return await conn.fetchval(self._prune_ended, older_than, limit, "dead")  # type: ignore[no-any-return]

    async def jobs_dead_tuples(self, conn: Executor) -> tuple[int, bool]:
        """Return the jobs table's dead tuples and whether this role may vacuum it."""
        row = await conn.fetchrow(self._jobs_dead_tuples)
        assert row is not None
        return row["dead"], row["owner"]

    async def vacuum_jobs(self, conn: Executor) -> None:
        """VACUUM the jobs table, unless another session is vacuuming it."""
        # Not the pool's command_timeout (meant for short statements on a silent connection):
        # a big table's VACUUM may take longer, and cancelled it would never finish.
        await conn.execute(self._vacuum_jobs, timeout=VACUUM_TIMEOUT)

    async def queue_stats(self, conn: Executor) -> Sequence[asyncpg.Record]:
        """Return per-queue counts: ready, scheduled, running, dead, expired, oldest_ready_age."""
        return await conn.fetch(self._queue_stats)

    async def archive_stats(self, conn: Executor) -> dict[str, int]:
        """Return jobs completed in the last minute per archived queue; empty if none archived."""
        rows = await conn.fetch(self._archive_stats)
        return {row["queue"]: row["completed"] for row in rows}

    async def table_stats(self, conn: Executor) -> asyncpg.Record:
        """Return size and vacuum figures of the jobs table."""
        table = f"{q.quote_schema(self.schema)}.jobs"
        row = await conn.fetchrow(self._table_stats, table)
        assert row is not None  # the regclass cast raises for a missing table
        return row

    async def arm_doorbell(
        self, conn: asyncpg.Connection, queues: Sequence[str], within: float
    ) -> bool:
        """Make inserts into these queues ring: a worker on this session is about to sleep.

        Return True if inserts that may not have rung were in flight (see
        :meth:`inserts_in_flight`).
        """
        return bool(await conn.fetchval(self._arm_doorbell, list(queues), timeout=within))

    async def inserts_in_flight(
        self, conn: asyncpg.Connection, queues: Sequence[str], within: float
    ) -> bool:
        """Return True if a transaction that inserted into these queues is still open."""
        return bool(await conn.fetchval(self._inserts_in_flight, list(queues), timeout=within))

    async def disarm_doorbell(
        self, conn: asyncpg.Connection, queues: Sequence[str], within: float
    ) -> None:
        """Stop the ringing that :meth:`arm_doorbell` asked for (the worker is awake)."""
        await conn.execute(self._disarm_doorbell, list(queues), timeout=within)

    # --- job control (issue 12) ---

    async def cancel_jobs(self, conn: Executor, ids: Sequence[int]) -> dict[int, str]:
        """Cancel pending jobs, request the cancel of running ones; return id -> state."""
        rows = await conn.fetch(
            self._cancel_jobs, list(ids), self.control_channel, self.results_channel
        )
        return {row[0]: row[1] for row in rows}

    async def cancel_requested(
        self, conn: Executor, ids: Sequence[int], numbers: Sequence[int], worker_id: str
    ) -> set[int]:
        """Return which of our running jobs someone asked to cancel."""
        rows = await conn.fetch(self._cancel_requested, ids, numbers, worker_id)
        return {row[0] for row in rows}

    async def cancel_running(
        self,
        conn: Executor,
        ids: Sequence[int],
        numbers: Sequence[int],
        worker_id: str,
        *,
        awaited: Sequence[bool],
    ) -> set[int]:
        """Mark our running jobs cancelled; ring waiters of the awaited; return the ids changed."""
        rows = await conn.fetch(
            self._cancel_running, ids, numbers, worker_id, awaited, self.results_channel
        )
        return {row[0] for row in rows}

    async def ring_results(self, conn: Executor, ids: Sequence[int]) -> None:
        """Wake the waiters of jobs that ended (a NOTIFY on the results channel each)."""
        await conn.fetchval(self._ring_results, self.results_channel, list(ids))

    async def complete_result(
        self,
        conn: Executor,
        ids: Sequence[int],
        numbers: Sequence[int],
        worker_id: str,
        *,
        results: Sequence[str],
        ttls: Sequence[float],
        archive: bool,
    ) -> set[int]:
        """Move finished jobs to results with their return values; return the ids still ours."""
        rows = await conn.fetch(
            self._complete_result,
            ids,
            numbers,
            worker_id,
            results,
            ttls,
            archive,
            self.results_channel,
        )
        return {row[0] for row in rows}

    async def set_progress(
        self,
        conn: Executor,
        job_id: int,
        number: int,
        worker_id: str,
        progress: float,
        note: str | None,
    ) -> bool:
        """Store a running job's progress; return False if the claim is no longer ours."""
        row = await conn.fetchrow(self._set_progress, job_id, number, worker_id, progress, note)
        return row is not None

    async def result_state(self, conn: Executor, job_id: int) -> asyncpg.Record | None:
        """Return (status, last_error, result, expired) of a job or its stored result."""
        return await conn.fetchrow(self._result_state, job_id)

    async def prune_results(self, conn: Executor, limit: int) -> int:
        """Delete up to ``limit`` results past their TTL."""
        return await conn.fetchval(self._prune_results, limit)  # type: ignore[no-any-return]

    async def prune_cancelled(self, conn: Executor, older_than: float, limit: int) -> int:
        """Delete up to ``limit`` jobs cancelled over ``older_than`` seconds ago."""
        return await conn.fetchval(self._prune_ended, older_than, limit, "cancelled")  # type: ignore[no-any-return]

    async def list_results(
        self, conn: Executor, *, task: str | None, queue: str | None, limit: int
    ) -> list[Job]:
        """Return succeeded jobs that kept an unexpired result, oldest first."""
        rows = await conn.fetch(self._list_results, task, queue, limit)
        return [Job.from_row(row) for row in rows]

    async def delete(self, conn: Executor, ids: Sequence[int]) -> Sequence[int]:
        """Delete these jobs if they are pending, dead or cancelled; return the ids deleted."""
        rows = await conn.fetch(self._delete, list(ids))
        return sorted(row[0] for row in rows)

    # --- per-minute history (aioq.stats_history) ---

    async def record_stats(
        self,
        conn: Executor,
        *,
        worker: str,
        host: str,
        pid: int,
        queues: Sequence[str],
        concurrency: int,
        queue: Sequence[str],
        task: Sequence[str],
        completed: Sequence[int],
        retried: Sequence[int],
        dead: Sequence[int],
        wait: Sequence[Sequence[int]],
        run: Sequence[Sequence[int]],
    ) -> None:
        """Upsert a worker's row and add its per-(queue, task) counts to the current minute."""
        width = len(wait[0]) if wait else 1
        await conn.execute(
            self._record_stats,
            worker,
            host,
            pid,
            list(queues),
            concurrency,
            list(queue),
            list(task),
            list(completed),
            list(retried),
            list(dead),
            [n for hist in wait for n in hist],
            [n for hist in run for n in hist],
            width,
        )

    async def prune_stats(self, conn: Executor, older_than: float, limit: int) -> None:
        """Delete up to ``limit`` history rows, and the workers, unseen for ``older_than`` s."""
        await conn.execute(self._prune_stats, older_than, limit)

    async def forget_worker(self, conn: Executor, worker_id: str) -> None:
        """Delete a worker's row (it stopped cleanly)."""
        await conn.execute(self._forget_worker, worker_id)

    async def recent_outcomes(self, conn: Executor) -> dict[str, tuple[int, int]]:
        """Return (completed, failed) per queue since the start of the previous minute."""
        rows = await conn.fetch(self._recent_outcomes)
        return {row["queue"]: (row["completed"], row["failed"]) for row in rows}

    async def ready_queues(self, conn: Executor) -> Sequence[str]:
        """Return the queues holding a job that is ready to run now."""
        return [row[0] for row in await conn.fetch(self._ready_queues)]

    async def waiting(self, conn: Executor, task: str) -> Sequence[asyncpg.Record]:
        """Return a task's pending jobs (due or scheduled), oldest first."""
        return await conn.fetch(self._waiting, task)

    # --- periodic jobs ---

    async def schedule_state(
        self, conn: Executor, names: Sequence[str]
    ) -> tuple[datetime, dict[str, datetime]]:
        """Return the database's clock and the last tick of each known schedule."""
        rows = await conn.fetch(self._schedule_state, list(names))
        last = {row["name"]: row["last_tick"] for row in rows if row["last_tick"] is not None}
        return rows[0]["now"], last

    async def start_schedule(
        self,
        conn: Executor,
        *,
        name: str,
        task: str,
        queue: str,
        spec: str,
        last_tick: datetime,
        next_tick: datetime,
    ) -> bool:
        """Record a schedule seen for the first time; False if it was there already."""
        row = await conn.fetchval(
            self._schedule_start, name, task, queue, spec, last_tick, next_tick
        )
        return row is not None

    async def tick(
        self,
        conn: Executor,
        *,
        name: str,
        task: str,
        queue: str,
        spec: str,
        ticks: Sequence[datetime],
        next_tick: datetime,
        args: str,
        priority: int,
        max_attempts: int,
        lease: float,
    ) -> Sequence[int]:
        """Enqueue one job per tick unless a tick at or after the first is enqueued already."""
        rows = await conn.fetch(
            self._schedule_tick,
            name,
            task,
            queue,
            spec,
            list(ticks),
            next_tick,
            args,
            priority,
            max_attempts,
            lease,
        )
        return [row[0] for row in rows]

    async def list_schedules(self, conn: Executor) -> Sequence[asyncpg.Record]:
        """Return every schedule the fleet has seen, by name."""
        return await conn.fetch(self._list_schedules)

    # --- queue limits ---

    async def limited_queues(
        self, conn: Executor, queues: Sequence[str]
    ) -> dict[str, float | None]:
        """Return which of these queues have a limit or are paused, with their rate period."""
        rows = await conn.fetch(self._limited_queues, list(queues))
        return {row[0]: row[1] for row in rows}

    async def lock_queue(self, conn: Connection, queue: str) -> bool | None:
        """Take a queue's turn to claim (in a transaction); return whether it is limited.

        None: the queue has no settings row.
        """
        return await conn.fetchval(self._lock_queue, queue)  # type: ignore[no-any-return]

    async def claim_limited(
        self, conn: Connection, queue: str, limit: int, worker_id: str
    ) -> tuple[Sequence[Claim], int | None]:
        """Claim as many of ``limit`` jobs as a limited queue has room for (after lock_queue).

        Returns the claims and what the rate allowed (None: the queue has no rate).
        """
        rows = await conn.fetch(self._claim_limited, queue, limit, worker_id)
        claims = [Claim.from_row(row) for row in rows if row["id"] is not None]
        return claims, (rows[0]["rate_room"] if rows else None)

    async def set_queue(
        self,
        conn: Executor,
        queue: str,
        *,
        max_running: tuple[bool, int | None],
        rate: tuple[bool, int | None, float | None],
        paused: tuple[bool, bool],
        must_exist: bool,
    ) -> bool:
        """Change what is given of a queue's settings; False if refused as unknown."""
        name = await conn.fetchval(
            self._set_queue,
            queue,
            *max_running,
            *rate,
            *paused,
            must_exist,
            self.channel,
        )
        return name is not None

    async def queue_settings(self, conn: Executor) -> Sequence[asyncpg.Record]:
        """Return every queue's settings and the claims in its rate window now."""
        return await conn.fetch(self._queue_settings)
