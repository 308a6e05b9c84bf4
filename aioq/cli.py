"""The ``aioq`` command line.

Each subcommand is one ``_cmd_<name>(args) -> int`` function registered in
:func:`_build_parser`. Exit status: 0 ok; 1 a check failed or nothing was found (``jobs show``
of an unknown id, ``stats --check`` over a threshold, ``schema status`` with pending
migrations); 2 a usage, configuration, connection or database error, printed on one line
(``--debug`` shows the traceback instead).
"""

from __future__ import annotations

__all__ = ("main",)

import argparse
import dataclasses
import importlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, NoReturn

import anyio
import asyncpg

from aioq import admin, migrate
from aioq.codec import encode_args
from aioq.errors import AioqError
from aioq.job import Job, JobStatus
from aioq.logs import formatter
from aioq.server import EmbeddedPostgres
from aioq.store import Store
from aioq.supervisor import PROCESS_INDEX_ENV, Supervisor
from aioq.task import DEFAULT_LEASE, DEFAULT_MAX_ATTEMPTS, Registry, check_text, default_registry
from aioq.worker import (
    DEFAULT_CONCURRENCY,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_SHUTDOWN_GRACE,
    Worker,
)

log = logging.getLogger("aioq.cli")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2
DEFAULT_SCHEMA = "aioq"
LISTEN_DSN_ENV = "AIOQ_LISTEN_DSN"

_Handler = Callable[[argparse.Namespace], int]
_DbCommand = Callable[[asyncpg.Connection, argparse.Namespace], Awaitable[int]]


class _UsageError(Exception):
    """A bad command line or environment: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """Report a usage error on one line and exit with status 2."""
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``aioq`` command line and return its exit status."""
    args = _build_parser().parse_args(argv)
    handler_ = logging.StreamHandler(sys.stderr)
    handler_.setFormatter(formatter(getattr(args, "log_format", "text")))
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, handlers=[handler_])
    handler: _Handler = args.handler
    try:
        return handler(args)
    except BaseException as exc:
        problem = _describe(_unwrap(exc))
        if problem is None or args.debug:
            raise
        print(f"aioq: error: {problem}", file=sys.stderr)
        return EXIT_ERROR


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str | None:
    """Return the one-line message of an expected error, or None to let it propagate."""
    if isinstance(exc, _UsageError):
        return str(exc)
    if isinstance(exc, AioqError):
        return exc.message
    if isinstance(exc, asyncpg.UndefinedTableError | asyncpg.InvalidSchemaNameError):
        return f"{exc} (is the schema installed? run: aioq schema apply)"
    if isinstance(exc, asyncpg.PostgresError):
        return f"database error: {type(exc).__name__}: {exc}"
    if isinstance(exc, OSError | asyncpg.InterfaceError | TimeoutError):
        return f"cannot reach the database: {type(exc).__name__}: {exc}"
    return None


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aioq", description="An asyncio job queue on PostgreSQL.")
    parser.add_argument(
        "--debug", action="store_true", help="log at DEBUG and show tracebacks of errors"
    )
    # Options every database command takes, also accepted after the command name.
    db = _Parser(add_help=False)
    db.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: $AIOQ_DSN)")
    db.add_argument("--schema", default=None, help=f"aioq's schema (default: {DEFAULT_SCHEMA})")
    db.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="as above")
    out = _Parser(add_help=False)
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    commands = parser.add_subparsers(title="commands", dest="command", required=True)

    dev = commands.add_parser(
        "dev",
        help="run a throwaway PostgreSQL until Ctrl-C",
        description="Start an embedded throwaway PostgreSQL, print AIOQ_DSN=<dsn> on "
        "stdout, and delete it on SIGINT (Ctrl-C) or SIGTERM.",
    )
    dev.add_argument("--port", type=int, help="TCP port on 127.0.0.1 (default: a free one)")
    dev.add_argument(
        "--no-fsync", action="store_true", help="turn fsync off: faster, unsafe on a crash"
    )
    dev.set_defaults(handler=_cmd_dev)

    worker = commands.add_parser(
        "worker",
        parents=[db],
        help="run workers for the tasks of a module",
        description="Import MODULE (the current directory comes first on sys.path) and run "
        "its tasks. The registry is MODULE's attribute REGISTRY when given; otherwise MODULE's "
        "attribute `registry` if it is an aioq.Registry, else aioq.default_registry (where "
        "@aioq.task registers). SIGTERM/SIGINT stop gracefully; a second one stops at once.",
    )
    worker.add_argument("target", metavar="MODULE[:REGISTRY]")
    worker.add_argument(
        "--queue", action="append", help="a queue to serve; repeat for more (default: default)"
    )
    worker.add_argument("--concurrency", type=_positive_int, default=DEFAULT_CONCURRENCY)
    worker.add_argument(
        "--processes", type=_positive_int, default=1, help="worker processes under a supervisor"
    )
    worker.add_argument("--log-format", choices=("text", "json"), default="text")
    worker.add_argument("--poll-interval", type=_duration, default=DEFAULT_POLL_INTERVAL)
    worker.add_argument("--shutdown-grace", type=_duration, default=DEFAULT_SHUTDOWN_GRACE)
    worker.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (needs aioq-pg[prometheus]); with"
        " --processes N, child i serves on PORT + i",
    )
    worker.add_argument("--metrics-addr", default="0.0.0.0", help="address for --metrics-port")
    worker.add_argument(
        "--keep-completed",
        action="store_true",
        help="move finished jobs to the archive table instead of deleting them",
    )
    worker.add_argument(
        "--listen-dsn",
        default=None,
        help="a direct connection for LISTEN when --dsn goes through PgBouncer in transaction"
        " mode (default: $AIOQ_LISTEN_DSN, else the DSN)",
    )
    worker.add_argument(
        "--no-statement-cache",
        dest="statement_cache",
        action="store_false",
        help="no prepared statements on the pool (PgBouncer in transaction mode)",
    )
    worker.set_defaults(handler=_cmd_worker)

    schema = commands.add_parser("schema", help="install or inspect the schema")
    actions = schema.add_subparsers(title="actions", dest="action", required=True)
    for name, handler, text in (
        ("apply", _cmd_schema_apply, "install or upgrade the schema in place"),
        ("sql", _cmd_schema_sql, "print the DDL (needs no database)"),
        ("status", _cmd_schema_status, "installed version and pending migrations; 1 if any"),
    ):
        actions.add_parser(name, parents=[db, out], help=text).set_defaults(handler=handler)

    stats = commands.add_parser(
        "stats", parents=[db, out], help="per-queue counts and the jobs table's health"
    )
    stats.add_argument("--watch", type=_duration, metavar="SECONDS", help="repeat until Ctrl-C")
    stats.add_argument("--check", action="store_true", help="exit 1 when a threshold is crossed")
    stats.add_argument("--max-age", type=_duration, help="oldest ready job's age, any queue")
    stats.add_argument("--max-dead", type=int, help="dead jobs in any queue")
    stats.set_defaults(handler=_cmd_stats)

    jobs = commands.add_parser("jobs", help="list, show, retry, cancel and purge jobs")
    verbs = jobs.add_subparsers(title="actions", dest="action", required=True)
    ls = verbs.add_parser("list", parents=[db, out], help="jobs in the table, oldest first")
    ls.add_argument("--status", choices=[s.value for s in JobStatus])
    ls.add_argument("--task")
    ls.add_argument("--queue")
    ls.add_argument("--limit", type=_positive_int, default=100)
    ls.set_defaults(handler=_cmd_jobs_list)
    show = verbs.add_parser("show", parents=[db, out], help="one job; exit 1 if not found")
    show.add_argument("id", type=int)
    show.set_defaults(handler=_cmd_jobs_show)
    retry = verbs.add_parser("retry", parents=[db, out], help="make dead jobs pending again")
    retry.add_argument("ids", type=int, nargs="*", metavar="ID")
    retry.add_argument("--dead", action="store_true", help="every dead job (or by task/queue)")
    retry.add_argument("--task")
    retry.add_argument("--queue")
    retry.set_defaults(handler=_cmd_jobs_retry)
    cancel = verbs.add_parser("cancel", parents=[db, out], help="delete pending jobs")
    cancel.add_argument("ids", type=int, nargs="+", metavar="ID")
    cancel.set_defaults(handler=_cmd_jobs_cancel)
    purge = verbs.add_parser("purge", parents=[db, out], help="delete dead jobs in batches")
    purge.add_argument("--dead", action="store_true", required=True, help="purge dead jobs")
    purge.add_argument("--older-than", type=_duration, metavar="DURATION", help="e.g. 7d")
    purge.set_defaults(handler=_cmd_jobs_purge)

    defer = commands.add_parser(
        "defer", parents=[db, out], help="enqueue a job by task name; print its id"
    )
    defer.add_argument("task", metavar="TASK")
    defer.add_argument("--args", default="{}", help="keyword arguments as a JSON object")
    defer.add_argument("--queue", default="default")
    defer.add_argument("--priority", type=int, default=0)
    defer.add_argument("--delay", type=_duration, default=0.0)
    defer.add_argument("--max-attempts", type=_positive_int, default=DEFAULT_MAX_ATTEMPTS)
    defer.set_defaults(handler=_cmd_defer)
    return parser


_DURATION = re.compile(r"^(\d+(?:\.\d*)?)\s*(s|m|h|d)?$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    """Parse ``30``, ``30s``, ``15m``, ``2h`` or ``7d`` into seconds."""
    found = _DURATION.fullmatch(text.strip())
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30s, 15m, 2h, 7d")
    return float(found[1]) * _UNITS[found[2] or "s"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _dsn(args: argparse.Namespace) -> str:
    dsn: str | None = args.dsn or os.environ.get("AIOQ_DSN")
    if not dsn:
        raise _UsageError("no database: pass --dsn or set AIOQ_DSN")
    return dsn


def _schema(args: argparse.Namespace) -> str:
    return args.schema or DEFAULT_SCHEMA


def _with_db(args: argparse.Namespace, command: _DbCommand) -> int:
    dsn = _dsn(args)

    async def run() -> int:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            return await command(conn, args)
        finally:
            await conn.close()

    return anyio.run(run)


def _cmd_dev(args: argparse.Namespace) -> int:
    """Run an embedded PostgreSQL until SIGINT or SIGTERM."""
    port: int | None = args.port
    fsync = not args.no_fsync
    return anyio.run(_dev, port, fsync)


async def _dev(port: int | None, fsync: bool) -> int:
    # Take over the signals before starting: one that arrives while the server
    # starts then waits in the queue and tears it down, instead of killing us
    # and leaving the server behind.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with EmbeddedPostgres(fsync=fsync, port=port) as pg:
            print(f"AIOQ_DSN={pg.dsn}", flush=True)
            log.info("PostgreSQL is running (data in %s); press Ctrl-C to stop it", pg.data_dir)
            async for signum in signals:
                log.info("received %s: stopping PostgreSQL", signal.Signals(signum).name)
                break
    return 0


# --- worker ---


def _cmd_worker(args: argparse.Namespace) -> int:
    """Run a worker, or ``--processes`` of them under a supervisor."""
    dsn = _dsn(args)
    registry = _load_registry(args.target)  # in the supervisor too: a typo fails at once
    if args.processes > 1:
        return _supervise(args, dsn)
    return anyio.run(_work, args, dsn, registry)


def _load_registry(target: str) -> Registry:
    module_name, _, attribute = target.partition(":")
    if not module_name:
        raise _UsageError(f"{target!r}: expected MODULE or MODULE:REGISTRY")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise _UsageError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    if attribute:
        registry = getattr(module, attribute, None)
        if not isinstance(registry, Registry):
            raise _UsageError(f"{module_name}.{attribute} is not an aioq.Registry")
        return registry
    found = getattr(module, "registry", None)
    return found if isinstance(found, Registry) else default_registry


def _supervise(args: argparse.Namespace, dsn: str) -> int:
    command = [sys.executable, "-m", "aioq", *(["--debug"] if args.debug else []), "worker"]
    command += [args.target, "--processes", "1", "--parent-pid", str(os.getpid())]
    command += ["--concurrency", str(args.concurrency), "--log-format", args.log_format]
    command += ["--poll-interval", str(args.poll_interval)]
    command += ["--shutdown-grace", str(args.shutdown_grace)]
    if args.metrics_port is not None:
        command += ["--metrics-port", str(args.metrics_port), "--metrics-addr", args.metrics_addr]
    if args.keep_completed:
        command += ["--keep-completed"]
    if not args.statement_cache:
        command += ["--no-statement-cache"]
    for queue in args.queue or ():
        command += ["--queue", queue]
    if args.schema:
        command += ["--schema", args.schema]
    # The DSN goes through the environment, not argv, where `ps` would show a password.
    env = {**os.environ, "AIOQ_DSN": dsn}
    if args.listen_dsn:
        env[LISTEN_DSN_ENV] = args.listen_dsn
    return Supervisor(command, args.processes, env=env).run()


async def _work(args: argparse.Namespace, dsn: str, registry: Registry) -> int:
    metrics = None
    if args.metrics_port is not None:
        from aioq import metrics as aioq_metrics  # only now: prometheus_client is optional

        port = args.metrics_port + int(os.environ.get(PROCESS_INDEX_ENV, "0"))
        metrics = aioq_metrics.start(port, args.metrics_addr)
        log.info("serving metrics on http://%s:%d/metrics", args.metrics_addr, port)
    worker = Worker(
        metrics=metrics,
        keep_completed=args.keep_completed,
        dsn=dsn,
        registry=registry,
        queues=args.queue or ("default",),
        concurrency=args.concurrency,
        schema=args.schema or None,  # "" means unset, as in every command
        poll_interval=args.poll_interval,
        shutdown_grace=args.shutdown_grace,
        statement_cache=args.statement_cache,
        listen_dsn=args.listen_dsn or os.environ.get(LISTEN_DSN_ENV) or None,
    )
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:

            async def on_signals() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if not worker.stopping.is_set():
                        log.info("received %s: stopping gracefully (again: at once)", name)
                        worker.stop()
                    else:
                        log.warning("received %s again: cancelling running jobs", name)
                        tg.cancel_scope.cancel()

            tg.start_soon(on_signals)
            if args.parent_pid is not None:
                tg.start_soon(_watch_parent, worker, args.parent_pid)
            await worker.run()
            tg.cancel_scope.cancel()
    return EXIT_OK


async def _watch_parent(worker: Worker, parent_pid: int) -> None:
    """Stop gracefully if the supervisor dies (we are then re-parented)."""
    while os.getppid() == parent_pid:  # noqa: ASYNC110 (no event tells us; poll)
        await anyio.sleep(1.0)
    log.warning("supervisor %d is gone: stopping", parent_pid)
    worker.stop()


# --- schema ---


def _cmd_schema_apply(args: argparse.Namespace) -> int:
    """Install or upgrade the schema."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        applied = await migrate.install(conn, _schema(args))
        state = await migrate.status(conn, _schema(args))
        if args.json:
            _print_json({"schema": state.schema, "applied": applied, "version": state.installed})
        elif applied:
            print(f"schema {state.schema}: applied migrations {_ints(applied)}")
        else:
            print(f"schema {state.schema}: up to date (version {state.installed})")
        return EXIT_OK

    return _with_db(args, run)


def _cmd_schema_sql(args: argparse.Namespace) -> int:
    """Print the DDL."""
    sql = migrate.schema_sql(_schema(args))
    if args.json:
        _print_json({"schema": _schema(args), "sql": sql})
    else:
        print(sql, end="")
    return EXIT_OK


def _cmd_schema_status(args: argparse.Namespace) -> int:
    """Print the installed version and pending migrations; exit 1 when some are pending."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        state = await migrate.status(conn, _schema(args))
        if args.json:
            _print_json(
                {
                    "schema": state.schema,
                    "installed": state.installed,
                    "latest": state.latest,
                    "pending": state.pending,
                }
            )
        else:
            _print_table(
                ("SCHEMA", "INSTALLED", "LATEST", "PENDING"),
                [(state.schema, state.installed, state.latest, _ints(state.pending) or "none")],
            )
        return EXIT_FAILED if state.pending else EXIT_OK

    return _with_db(args, run)


# --- stats ---


def _cmd_stats(args: argparse.Namespace) -> int:
    """Print queue counts and table health; with --check, exit 1 when a threshold is crossed."""
    if args.watch is not None and args.check:
        raise _UsageError("--watch and --check do not go together")
    if (args.max_age is not None or args.max_dead is not None) and not args.check:
        raise _UsageError("--max-age and --max-dead need --check")

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        while True:
            snapshot = await admin.stats(conn, schema=_schema(args))
            failures = _check(snapshot, args) if args.check else []
            _print_stats(snapshot, args, failures)
            sys.stdout.flush()  # a pipe (| tee, a log collector) sees each sample at once
            if args.watch is None:
                return EXIT_FAILED if failures else EXIT_OK
            await anyio.sleep(args.watch)

    try:
        return _with_db(args, run)
    except KeyboardInterrupt:
        return EXIT_OK


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
        _print_json(out)
        return
    if args.watch is not None:
        print(f"--- {datetime.now(UTC):%Y-%m-%d %H:%M:%SZ}")
    rows = [
        (
            q.queue,
            q.ready,
            q.scheduled,
            q.running,
            q.dead,
            f"{q.oldest_ready_age:.1f}",
            q.expired_leases,
            "n/a" if q.completed_last_minute is None else q.completed_last_minute,
        )
        for q in snapshot.queues
    ]
    headers = ("QUEUE", "READY", "SCHEDULED", "RUNNING", "DEAD", "OLDEST_READY_S")
    _print_table((*headers, "EXPIRED_LEASES", "COMPLETED_1M"), rows)
    t = snapshot.table
    print(
        f"jobs table: {_size(t.table_bytes)}, indexes {_size(t.index_bytes)},"
        f" dead tuples {t.dead_tuples if t.dead_tuples is not None else 'n/a'},"
        f" last autovacuum {_time(t.last_autovacuum) or 'never'}"
    )
    for failure in failures:
        print(f"CHECK FAILED: {failure}")
    if args.check and not failures:
        print("check ok")


# --- jobs ---


def _cmd_jobs_list(args: argparse.Namespace) -> int:
    """List jobs, oldest first."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        found = await admin.list_jobs(
            conn,
            status=args.status,
            task=args.task,
            queue=args.queue,
            limit=args.limit,
            schema=_schema(args),
        )
        if args.json:
            _print_json([_job_dict(job) for job in found])
            return EXIT_OK
        rows = [
            (
                job.id,
                job.queue,
                job.task,
                job.status.value,
                f"{job.attempts}/{job.max_attempts}",
                _time(job.run_at),
                (job.last_error or "").split("\n", 1)[0][:60],
            )
            for job in found
        ]
        headers = ("ID", "QUEUE", "TASK", "STATUS", "ATTEMPTS", "RUN_AT", "LAST_ERROR")
        _print_table(headers, rows)
        return EXIT_OK

    return _with_db(args, run)


def _cmd_jobs_show(args: argparse.Namespace) -> int:
    """Show one job; exit 1 if it is not in the table."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        job = await admin.get_job(conn, args.id, schema=_schema(args))
        if job is None:
            print(f"aioq: job {args.id} not found (finished, cancelled or never existed)",
                  file=sys.stderr)  # fmt: skip
            return EXIT_FAILED
        values = _job_dict(job)
        if args.json:
            _print_json(values)
            return EXIT_OK
        for key, value in values.items():
            if key == "args":
                value = json.dumps(value)
            elif value is None:
                value = "-"
            print(f"{key + ':':<18}{value}")
        return EXIT_OK

    return _with_db(args, run)


def _cmd_jobs_retry(args: argparse.Namespace) -> int:
    """Make dead jobs pending again; exit 1 if a given id was not a dead job."""
    if bool(args.ids) == args.dead:
        raise _UsageError("jobs retry: give job ids or --dead (not both)")
    if args.ids and (args.task or args.queue):
        raise _UsageError("jobs retry: --task and --queue go with --dead")

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        retried = await admin.retry_dead(
            conn,
            job_id=args.ids or None,
            task=args.task,
            queue=args.queue,
            all=args.dead,
            schema=_schema(args),
        )
        return _report(args, "retried", retried, "not dead jobs")

    return _with_db(args, run)


def _cmd_jobs_cancel(args: argparse.Namespace) -> int:
    """Delete pending jobs; exit 1 if a given id was not pending."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        cancelled = await admin.cancel_jobs(conn, args.ids, schema=_schema(args))
        return _report(args, "cancelled", cancelled, "not pending jobs")

    return _with_db(args, run)


def _report(args: argparse.Namespace, verb: str, done: list[int], missing_are: str) -> int:
    missing = sorted(set(args.ids) - set(done))
    if args.json:
        _print_json({verb: done, "missing": missing})
    else:
        print(f"{verb} {len(done)} jobs" + (f": {_ints(done)}" if done else ""))
        if missing:
            print(f"{missing_are} (or not found): {_ints(missing)}")
    return EXIT_FAILED if missing else EXIT_OK


def _cmd_jobs_purge(args: argparse.Namespace) -> int:
    """Delete dead jobs, optionally only old ones, in bounded batches."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        count = await admin.purge_dead(conn, older_than=args.older_than, schema=_schema(args))
        if args.json:
            _print_json({"purged": count})
        else:
            print(f"purged {count} dead jobs")
        return EXIT_OK

    return _with_db(args, run)


# --- defer ---


def _cmd_defer(args: argparse.Namespace) -> int:
    """Enqueue a job by task name (the task need not be importable); print its id."""
    try:
        values = json.loads(args.args)
    except ValueError as exc:
        raise _UsageError(f"--args is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise _UsageError(f"--args must be a JSON object, got {type(values).__name__}")
    check_text("task", args.task)
    check_text("queue", args.queue)
    encoded = encode_args(args.task, values)

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        job_id = await Store.for_schema(_schema(args)).insert(
            conn,
            queue=args.queue,
            task=args.task,
            args=encoded,
            priority=args.priority,
            run_at=None,
            delay=args.delay,
            max_attempts=args.max_attempts,
            lease=DEFAULT_LEASE,
            unique_key=None,
        )
        if args.json:
            _print_json({"id": job_id})
        else:
            print(job_id)
        return EXIT_OK

    return _with_db(args, run)


# --- output ---


def _job_dict(job: Job) -> dict[str, Any]:
    values = dataclasses.asdict(job)
    values["status"] = job.status.value
    values["args"] = json.loads(job.args)
    return values


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=_json_default))


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        print("(none)")


def _time(value: datetime | None) -> str:
    return f"{value.astimezone(UTC):%Y-%m-%d %H:%M:%SZ}" if value is not None else ""


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _ints(values: Sequence[int]) -> str:
    return " ".join(str(v) for v in values)
