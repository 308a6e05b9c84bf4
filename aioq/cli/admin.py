"""``aioq schema``, ``stats``, ``jobs`` and ``defer``: look after the queue from a shell."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import UTC, datetime
from typing import Any

import anyio
import asyncpg

from aioq import admin, migrate
from aioq.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    counted,
    format_ints,
    format_size,
    format_time,
    job_dict,
    load_registry,
    print_json,
    print_table,
    schema_from,
    until_interrupted,
    with_db,
)
from aioq.codec import encode_args
from aioq.defer import insert_job
from aioq.job import Job, JobStatus
from aioq.options import JobOptions, check_text
from aioq.sql.admin import ARCHIVE_IN_USE


def cmd_schema_apply(args: argparse.Namespace) -> int:
    """Install or upgrade the schema."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        applied = await migrate.install(conn, schema_from(args), ring_trigger=args.ring_trigger)
        state = await migrate.status(conn, schema_from(args))
        if args.json:
            print_json({"schema": state.schema, "applied": applied, "version": state.installed})
        elif applied:
            print(f"schema {state.schema}: applied migrations {format_ints(applied)}")
        else:
            print(f"schema {state.schema}: up to date (version {state.installed})")
        return EXIT_OK

    return with_db(args, run)


def cmd_schema_sql(args: argparse.Namespace) -> int:
    """Print the SQL that installs the schema, or upgrades it from --from, recording versions;
    with --ring-trigger, the opt-in doorbell trigger's DDL alone."""
    if args.ring_trigger:
        print(migrate.ring_trigger_sql(schema_from(args)), end="")
        return EXIT_OK
    latest = migrate.latest_version()
    to = latest if args.to is None else args.to
    if not 0 <= args.from_version <= to <= latest:
        raise UsageError(
            f"schema sql: --from {args.from_version} --to {to}: the versions go from 0 (nothing"
            f" installed) to {latest}, the latest this aioq knows, upwards"
        )
    sql = migrate.schema_sql(schema_from(args), from_version=args.from_version, to_version=to)
    if args.json:
        print_json({"schema": schema_from(args), "from": args.from_version, "to": to, "sql": sql})
    else:
        print(sql, end="")
    return EXIT_OK


def cmd_schema_status(args: argparse.Namespace) -> int:
    """Print the installed version and pending migrations; exit 1 when some are pending."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        state = await migrate.status(conn, schema_from(args))
        if args.json:
            print_json(
                {
                    "schema": state.schema,
                    "installed": state.installed,
                    "latest": state.latest,
                    "pending": state.pending,
                }
            )
        else:
            print_table(
                ("SCHEMA", "INSTALLED", "LATEST", "PENDING"),
                [
                    (
                        state.schema,
                        state.installed,
                        state.latest,
                        format_ints(state.pending) or "none",
                    )
                ],
            )
        return EXIT_FAILED if state.pending else EXIT_OK

    return with_db(args, run)


# --- stats ---

MIN_WATCH = 0.1
"""The shortest --watch interval: each sample runs the full stats statements."""


def cmd_stats(args: argparse.Namespace) -> int:
    """Print queue counts and table health; with --check, exit 1 when a threshold is crossed."""
    if args.watch is not None and args.check:
        raise UsageError("--watch and --check do not go together")
    if args.watch is not None and not args.watch >= MIN_WATCH:
        raise UsageError(f"--watch must be at least {MIN_WATCH:g} seconds, got {args.watch:g}")
    if (args.max_age is not None or args.max_dead is not None) and not args.check:
        raise UsageError("--max-age and --max-dead need --check")

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        while True:
            snapshot = await admin.stats(conn, schema=schema_from(args))
            failures = _check(snapshot, args) if args.check else []
            _print_stats(snapshot, args, failures)
            sys.stdout.flush()  # a pipe (| tee, a log collector) sees each sample at once
            if args.watch is None:
                return EXIT_FAILED if failures else EXIT_OK
            await anyio.sleep(args.watch)

    return with_db(args, run) if args.watch is None else until_interrupted(args, run)


def _check(snapshot: admin.Stats, args: argparse.Namespace) -> list[str]:
    failures = []
    for q in snapshot.queues:
        if args.max_age is not None and q.oldest_ready_age > args.max_age:
            failures.append(
                f"queue {q.queue}: oldest ready job is {q.oldest_ready_age:.1f}s old"
                f" (--max-age {args.max_age:g})"
            )
        if args.max_dead is not None and q.dead > args.max_dead:
            failures.append(f"queue {q.queue}: {q.dead} dead jobs (--max-dead {args.max_dead})")
    return failures


def _print_stats(snapshot: admin.Stats, args: argparse.Namespace, failures: list[str]) -> None:
    if args.json:
        out: dict[str, Any] = dataclasses.asdict(snapshot)
        if args.check:
            out["check"] = {"ok": not failures, "failures": failures}
        print_json(out)
        return
    if args.watch is not None:
        print(f"--- {datetime.now(UTC):%Y-%m-%d %H:%M:%SZ}")
    rows = [
        (
            q.queue,
            q.ready,
            q.scheduled,
            q.waiting,
            q.running,
            q.dead,
            q.cancelled,
            f"{q.oldest_ready_age:.1f}",
            q.expired_leases,
            "n/a" if q.completed_last_minute is None else q.completed_last_minute,
            "n/a" if q.failed_last_minute is None else q.failed_last_minute,
        )
        for q in snapshot.queues
    ]
    counts = ("READY", "SCHEDULED", "WAITING", "RUNNING", "DEAD", "CANCELLED", "OLDEST_READY_S")
    print_table(("QUEUE", *counts, "EXPIRED_LEASES", "COMPLETED_1M", "FAILED_1M"), rows)
    t = snapshot.table
    print(
        f"jobs table: {format_size(t.table_bytes)}, indexes {format_size(t.index_bytes)},"
        f" dead tuples {t.dead_tuples if t.dead_tuples is not None else 'n/a'},"
        f" last autovacuum {format_time(t.last_autovacuum) or 'never'}"
    )
    for u in snapshot.unknown_tasks:
        print(
            f"waiting for a worker that knows task {u.task} (queue {u.queue}):"
            f" {u.jobs} {'job' if u.jobs == 1 else 'jobs'}, since {format_time(u.since)}"
        )
    for failure in failures:
        print(f"CHECK FAILED: {failure}")
    if args.check and not failures:
        print("check ok")


# --- jobs ---


def cmd_jobs_list(args: argparse.Namespace) -> int:
    """List jobs, oldest first."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        found = await admin.list_jobs(
            conn,
            status=args.status,
            task=args.task,
            queue=args.queue,
            limit=args.limit,
            schema=schema_from(args),
        )
        if args.json:
            print_json([job_dict(job) for job in found])
            return EXIT_OK
        rows = [
            (
                job.id,
                job.queue,
                job.task,
                _status(job),
                f"{job.attempts}/{job.max_attempts}",
                format_time(job.run_at),
                (job.last_error or "").split("\n", 1)[0][:60],
            )
            for job in found
        ]
        headers = ("ID", "QUEUE", "TASK", "STATUS", "ATTEMPTS", "RUN_AT", "LAST_ERROR")
        print_table(headers, rows)
        return EXIT_OK

    return with_db(args, run)


def _status(job: Job) -> str:
    """A job's status, and for a job waiting for a worker that knows its task, that."""
    if job.status is JobStatus.PENDING and job.unknown_since is not None:
        since = format_time(job.unknown_since)
        return f"pending (waits for a worker that knows its task since {since})"
    return job.status.value


def cmd_jobs_show(args: argparse.Namespace) -> int:
    """Show one job (from the archive if it succeeded and was kept); exit 1 if not found."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        job = await admin.get_job(conn, args.id, schema=schema_from(args))
        if job is None:
            print(f"aioq: job {args.id} not found: {await _why_not_found(conn, args)}",
                  file=sys.stderr)  # fmt: skip
            return EXIT_FAILED
        values = job_dict(job)
        if args.json:
            print_json(values)
            return EXIT_OK
        values["status"] = _status(job)
        width = max(len(key) for key in values) + 2  # every value in one column
        for key, value in values.items():
            if key == "args" or (key == "result" and job.result is not None):
                value = json.dumps(value)
            elif value is None:
                value = "-"
            print(f"{key + ':':<{width}}{value}")
        return EXIT_OK

    return with_db(args, run)


async def _why_not_found(conn: asyncpg.Connection, args: argparse.Namespace) -> str:
    if await ARCHIVE_IN_USE.row(conn, schema_from(args)):
        return (
            "it is not in the jobs table nor in the archive (pruned after archive_retention or"
            " dead_retention, finished on a worker without --keep-completed, or never existed)"
        )
    return (
        "finished jobs are deleted unless workers keep them in the archive"
        " (aioq worker --keep-completed, Worker(keep_completed=True)) or keep a result"
        " (result_ttl); or it was pruned, or never existed"
    )


def cmd_jobs_replay(args: argparse.Namespace) -> int:
    """Make dead jobs pending again; exit 1 if a given id was not a dead job."""
    return _replay(args, "replayed")


def cmd_jobs_retry(args: argparse.Namespace) -> int:
    """``jobs replay``'s old spelling, kept one release: says so on stderr, and prints what it
    always printed (``retried``, in the text and as the JSON key) for the scripts that read it."""
    print(
        "aioq: 'aioq jobs retry' is deprecated and will be removed in the next release: use"
        ' \'aioq jobs replay\' (its --json says "replayed" instead of "retried")',
        file=sys.stderr,
    )
    return _replay(args, "retried")


def _replay(args: argparse.Namespace, verb: str) -> int:
    if bool(args.ids) == args.dead:
        raise UsageError(f"jobs {args.action}: give job ids or --dead (not both)")
    if args.ids and (args.task or args.queue):
        raise UsageError(f"jobs {args.action}: --task and --queue go with --dead")

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        replay = await admin.replay(
            conn,
            job_id=args.ids or None,
            task=args.task,
            queue=args.queue,
            all=args.dead,
            schema=schema_from(args),
        )
        return _report(
            args,
            verb,
            replay.replayed,
            "not dead jobs",
            skipped=replay.skipped,
            revived=replay.revived,
        )

    return with_db(args, run)


_CANCEL_LINES = {
    "cancelled": "cancelled {n}",
    "cancelling": "cancelling {n} (their workers stop them)",
    "finished": "already finished (kept their outcome)",
    "dead": "already dead (not cancelled)",
    "missing": "not found",
}


def cmd_jobs_cancel(args: argparse.Namespace) -> int:
    """Cancel jobs, running ones too; exit 1 if a given id had already ended or was not found."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        states = await admin.cancel_jobs(conn, args.ids, schema=schema_from(args))
        by_state: dict[str, list[int]] = {state: [] for state in admin.CANCEL_STATES}
        for job_id, state in states.items():
            by_state[state].append(job_id)
        if args.json:
            print_json(by_state)
        else:
            for state, line in _CANCEL_LINES.items():
                ids = by_state[state]
                if ids or state == "cancelled":
                    noun = "running job" if state == "cancelling" else "job"
                    head = line.format(n=counted(len(ids), noun))
                    print(f"{head}: {format_ints(ids)}" if ids else head)
        ended = by_state["finished"] or by_state["dead"] or by_state["missing"]
        return EXIT_FAILED if ended else EXIT_OK

    return with_db(args, run)


def _report(
    args: argparse.Namespace,
    verb: str,
    done: list[int],
    missing_are: str,
    *,
    skipped: dict[int, str] | None = None,
    revived: dict[int, str] | None = None,
) -> int:
    """Print what was done; exit 1 if a job asked for by id was not done.

    ``revived``: workflow steps a replay brought back to waiting (job id -> step name).
    """
    skipped = skipped or {}
    missing = sorted(set(args.ids) - set(done) - set(skipped))
    if args.json:
        out: dict[str, object] = {verb: done, "missing": missing}
        if skipped:
            out["skipped"] = {str(job_id): why for job_id, why in skipped.items()}
        if revived:
            out["revived"] = {str(job_id): name for job_id, name in revived.items()}
        print_json(out)
    else:
        print(f"{verb} {counted(len(done), 'job')}" + (f": {format_ints(done)}" if done else ""))
        if revived:
            steps = ", ".join(f"{job_id} ({name})" for job_id, name in revived.items())
            print(f"revived {counted(len(revived), 'dependent step')}, waiting again: {steps}")
        for job_id, why in skipped.items():
            print(f"skipped job {job_id}: {why}")
        if missing:
            print(f"{missing_are} (or not found): {format_ints(missing)}")
    return EXIT_FAILED if missing or set(args.ids) & set(skipped) else EXIT_OK


def cmd_jobs_purge(args: argparse.Namespace) -> int:
    """Delete dead jobs, optionally only old ones, in bounded batches."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        count = await admin.purge_dead(conn, older_than=args.older_than, schema=schema_from(args))
        if args.json:
            print_json({"purged": count})
        else:
            print(f"purged {count} dead jobs")
        return EXIT_OK

    return with_db(args, run)


# --- defer ---


def cmd_defer(args: argparse.Namespace) -> int:
    """Enqueue a job by task name and print its id.

    With MODULE[:REGISTRY] the task must exist there: its options apply (flags override) and
    the arguments are checked as ``Task.defer`` checks them. Without it, the task need not be
    importable, and only the flags decide where and how the job runs.
    """
    try:
        values = json.loads(args.args)
    except ValueError as exc:
        raise UsageError(f"--args is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise UsageError(f"--args must be a JSON object, got {type(values).__name__}")
    name: str = args.task
    check_text("task", name)
    if args.target is None:
        opts = JobOptions(**_defer_flags(args))
        schema = schema_from(args)
        encoded = encode_args(name, values)
    else:
        registry = load_registry(args.target)
        task = registry.get(name)
        if task is None:
            known = ", ".join(sorted(registry)) or "none"
            raise UsageError(f"no task named {name!r} in {args.target} (registered: {known})")
        opts = task.options(**_defer_flags(args)).opts
        schema = args.schema or registry.schema
        # The JSON forms of typed values (docs/tasks.md), read as the task would read them.
        encoded = task.encode(task.codec.read(task.bind((), values)))

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        job_id = await insert_job(schema, conn, name, opts, encoded)
        if args.target is None:  # once the job is written: a failure needs no note
            print(
                f"aioq: note: no registry given, so the options of task {name!r} are unknown:"
                f" the job goes to queue {opts.queue!r} with max_attempts {opts.max_attempts}"
                " and its arguments unchecked (name MODULE:REGISTRY before the task to use its"
                " own)",
                file=sys.stderr,
            )
        if args.json:
            print_json({"id": job_id, "queue": opts.queue})
        else:
            print(job_id)
        return EXIT_OK

    return with_db(args, run)


def _defer_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line (those left out keep the task's or defaults)."""
    flags = {
        "queue": args.queue,
        "priority": args.priority,
        "delay": args.delay,
        "max_attempts": args.max_attempts,
        "lease": args.lease,
        "unique_key": args.unique_key,
    }
    return {k: v for k, v in flags.items() if v is not None}
