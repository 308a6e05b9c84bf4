"""The ``aioq`` command line.

Each subcommand is one ``cmd_<name>(args) -> int`` function (``aioq/cli/worker.py`` runs
servers and workers, ``aioq/cli/admin.py`` looks after the queue), declared with its options by
one builder (``_worker_command``, ...) that :func:`_build_parser` calls in ``--help`` order.
Exit status: 0 ok, including an empty ``jobs list`` (a listing that found nothing answered its
question, as ``ls`` and ``psql`` do); 1 a check failed or a job named on the command line was
not found (``jobs show`` of an unknown id, ``jobs replay``/``cancel`` of ids that were not
dead/pending, ``stats --check`` over a threshold, ``schema status`` with pending migrations);
2 a usage, configuration, connection or database error, printed on one
line (``--debug`` shows the traceback instead); 141 (128 + SIGPIPE), silently, when stdout's
reader went away (``| head``).
"""

from __future__ import annotations

__all__ = ("main",)

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import asyncpg

from aioq.admin import UNSET
from aioq.cli.admin import (
    cmd_defer,
    cmd_jobs_cancel,
    cmd_jobs_list,
    cmd_jobs_purge,
    cmd_jobs_replay,
    cmd_jobs_retry,
    cmd_jobs_show,
    cmd_schema_apply,
    cmd_schema_sql,
    cmd_schema_status,
    cmd_stats,
)
from aioq.cli.common import (
    EXIT_ERROR,
    UsageError,
    duration,
    non_negative_int,
    port_number,
    positive_int,
    row_limit,
    use_django,
)
from aioq.cli.queues import (
    cmd_queues_list,
    cmd_queues_pause,
    cmd_queues_resume,
    cmd_queues_set,
    max_running,
    rate,
)
from aioq.cli.schedules import cmd_schedules
from aioq.cli.web import cmd_web
from aioq.cli.worker import DEFAULT_METRICS_ADDR, add_worker_flags, cmd_dev, cmd_worker
from aioq.cli.workflows import cmd_workflows_cancel, cmd_workflows_list, cmd_workflows_show
from aioq.errors import AioqError
from aioq.job import JobStatus
from aioq.logs import formatter
from aioq.sql import DEFAULT_SCHEMA
from aioq.worker.health import DEFAULT_HEALTH_ADDR

_Handler = Callable[[argparse.Namespace], int]

# What a shell reports for a command killed by SIGPIPE (`yes | head -1; echo ${PIPESTATUS[0]}`).
EXIT_SIGPIPE = 128 + signal.SIGPIPE


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """Report a usage error on one line and exit with status 2."""
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``aioq`` command line and return its exit status."""
    args = _build_parser().parse_args(argv)
    handler_ = logging.StreamHandler(sys.stderr)
    handler_.setFormatter(formatter(getattr(args, "log_format", "text")))
    level = "DEBUG" if args.debug else getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, handlers=[handler_])
    handler: _Handler = args.handler
    try:
        if args.django:
            use_django(args)
        status = handler(args)
        sys.stdout.flush()  # a pipe's reader that left shows here, inside the try
        return status
    except BaseException as exc:
        if isinstance(_unwrap(exc), BrokenPipeError):
            return _stdout_closed()
        problem = _describe(_unwrap(exc))
        if problem is None or args.debug:
            raise
        print(f"aioq: error: {problem}", file=sys.stderr)
        return EXIT_ERROR


def _stdout_closed() -> int:
    """End quietly once stdout's reader is gone (``| head``), as a Unix tool killed by SIGPIPE."""
    # Point stdout at /dev/null so the interpreter's final flush of what is still buffered
    # does not raise again ("Exception ignored ... BrokenPipeError") on the way out.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_SIGPIPE


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str | None:
    """Return the one-line message of an expected error, or None to let it propagate."""
    if isinstance(exc, UsageError):
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
    """The whole command line: global options, then one builder per command, in --help order."""
    parser = _Parser(prog="aioq", description="An asyncio job queue on PostgreSQL.")
    debug_help = "log at DEBUG and show tracebacks of errors"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    django_help = (
        "set up this Django project (its settings module) first: the DSN, schema and queues"
        " default to its aioq TASKS backend's, and the worker runs its Django tasks"
    )
    parser.add_argument("--django", metavar="SETTINGS", default=None, help=django_help)
    backend_help = "the TASKS alias of the aioq backend to use (default: the only one, or default)"
    parser.add_argument("--tasks-backend", metavar="ALIAS", default=None, help=backend_help)
    # Options every database command takes, also accepted after the command name.
    db = _Parser(add_help=False)
    db.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: $AIOQ_DSN)")
    db.add_argument("--schema", default=None, help=f"aioq's schema (default: {DEFAULT_SCHEMA})")
    # The global options' help again: `aioq COMMAND --help` shows only these.
    db.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    db.add_argument("--django", metavar="SETTINGS", default=argparse.SUPPRESS, help=django_help)
    db.add_argument(
        "--tasks-backend", metavar="ALIAS", default=argparse.SUPPRESS, help=backend_help
    )
    out = _Parser(add_help=False)
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    commands = parser.add_subparsers(title="commands", dest="command", required=True)
    _dev_command(commands)
    _worker_command(commands, db)
    _schema_command(commands, [db, out])
    _stats_command(commands, [db, out])
    _jobs_command(commands, [db, out])
    _workflows_command(commands, [db, out])
    _web_command(commands, db)
    _queues_command(commands, [db, out])
    _schedules_command(commands, [db, out])
    _defer_command(commands, [db, out])
    return parser


# What add_subparsers returns (argparse keeps the class private).
_Commands = Any
_Parents = list[argparse.ArgumentParser]


def _dev_command(commands: _Commands) -> None:
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
    dev.set_defaults(handler=cmd_dev)


def _worker_command(commands: _Commands, db: argparse.ArgumentParser) -> None:
    worker = commands.add_parser(
        "worker",
        parents=[db],
        help="run workers for the tasks of a module",
        description="Import MODULE (the current directory comes first on sys.path) and run "
        "its tasks. The registry is MODULE's attribute REGISTRY when given; otherwise MODULE's "
        "attribute `registry` if it is an aioq.Registry, else aioq.registry.default_registry (where "
        "@aioq.task registers). With --django SETTINGS, MODULE is optional: the project's "
        "Django tasks run too, found by the module path their jobs carry. SIGTERM/SIGINT stop "
        "gracefully; a second one stops at once.",
    )
    worker.add_argument("target", metavar="MODULE[:REGISTRY]", nargs="?")
    worker.add_argument(
        "--queue",
        action="append",
        help="a queue to serve; repeat for more (default: 'default' and every queue the"
        " registry's tasks name)",
    )
    worker.add_argument(
        "--processes", type=positive_int, default=1, help="worker processes under a supervisor"
    )
    worker.add_argument("--log-format", choices=("text", "json"), default="text")
    worker.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="info logs one line per job outcome; warning keeps failures, dead jobs and lost"
        " leases (default: %(default)s)",
    )
    add_worker_flags(worker)
    worker.add_argument(
        "--no-gc-tuning",
        dest="gc_tuning",
        action="store_false",
        help="leave Python's garbage collector as it is (by default the worker process freezes"
        " what start-up allocated and collects its youngest generation less often)",
    )
    worker.add_argument(
        "--worker-id",
        default=None,
        metavar="ID",
        help="this worker's id, held for its life: a second live worker with the same id refuses"
        " to start; with --processes N, child i is ID-i (default: host:pid:random)",
    )
    worker.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    _endpoint_flags(worker)
    worker.add_argument(
        "--listen-dsn",
        default=None,
        help="a direct connection for LISTEN when --dsn goes through PgBouncer in transaction"
        " mode (default: $AIOQ_LISTEN_DSN, else the DSN)",
    )
    worker.set_defaults(handler=cmd_worker)


def _endpoint_flags(worker: argparse.ArgumentParser) -> None:
    """The worker's HTTP endpoints: Prometheus metrics and the health probes."""
    worker.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="PORT",
        help="serve Prometheus /metrics on this port (needs aioq-pg[prometheus]); with"
        " --processes N, child i serves on PORT + i",
    )
    worker.add_argument(
        "--metrics-addr",
        default=DEFAULT_METRICS_ADDR,
        help="address for --metrics-port (default: %(default)s; 0.0.0.0 for a scraper on"
        " another host)",
    )
    worker.add_argument(
        "--health-port",
        type=port_number,
        default=None,
        metavar="PORT",
        help="serve GET /livez and /readyz on this port (Kubernetes probes); with --processes"
        " N, child i serves on PORT + i",
    )
    worker.add_argument(
        "--health-addr",
        default=DEFAULT_HEALTH_ADDR,
        help="address for --health-port (default: %(default)s; 0.0.0.0 for probes from"
        " outside the pod's network namespace)",
    )


def _schema_command(commands: _Commands, parents: _Parents) -> None:
    schema = commands.add_parser("schema", help="install or inspect the schema")
    actions = schema.add_subparsers(title="actions", dest="action", required=True)
    apply = actions.add_parser(
        "apply", parents=parents, help="install or upgrade the schema in place"
    )
    apply.add_argument(
        "--ring-trigger",
        action="store_true",
        help="also install the opt-in doorbell trigger for jobs inserted with raw SQL",
    )
    apply.set_defaults(handler=cmd_schema_apply)
    sql = actions.add_parser(
        "sql",
        parents=parents,
        help="print the SQL that installs or upgrades the schema (needs no database)",
        description="Print the SQL that brings the schema from version --from (0: nothing"
        " installed) to --to (default: the latest), for psql or a migration tool. It records"
        " each migration it applies, so `aioq schema status` and the workers see the version,"
        " and it refuses to run on a schema at another version than --from. Run it once, in"
        " one transaction (psql -1).",
    )
    sql.add_argument(
        "--from",
        dest="from_version",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="the installed version to upgrade from (default: 0, a fresh install)",
    )
    sql.add_argument(
        "--to", type=non_negative_int, default=None, metavar="M", help="default: the latest"
    )
    sql.add_argument(
        "--ring-trigger",
        action="store_true",
        help="print the opt-in doorbell trigger's DDL alone (for jobs inserted with raw SQL)",
    )
    sql.set_defaults(handler=cmd_schema_sql)
    actions.add_parser(
        "status", parents=parents, help="installed version and pending migrations; 1 if any"
    ).set_defaults(handler=cmd_schema_status)


def _stats_command(commands: _Commands, parents: _Parents) -> None:
    stats = commands.add_parser(
        "stats", parents=parents, help="per-queue counts and the jobs table's health"
    )
    stats.add_argument(
        "--watch",
        type=duration,
        metavar="SECONDS",
        help="repeat every SECONDS (at least 0.1) until Ctrl-C or SIGTERM",
    )
    stats.add_argument("--check", action="store_true", help="exit 1 when a threshold is crossed")
    stats.add_argument("--max-age", type=duration, help="oldest ready job's age, any queue")
    stats.add_argument("--max-dead", type=int, help="dead jobs in any queue")
    stats.set_defaults(handler=cmd_stats)


def _jobs_command(commands: _Commands, parents: _Parents) -> None:
    jobs = commands.add_parser("jobs", help="list, show, replay, cancel and purge jobs")
    # `jobs retry`, replay's old spelling, is kept one release out of the help: no help= (no
    # line in the list) and a metavar without it.
    verbs = jobs.add_subparsers(
        title="actions", dest="action", required=True, metavar="{list,show,replay,cancel,purge}"
    )
    ls = verbs.add_parser("list", parents=parents, help="jobs in the table, oldest first")
    ls.add_argument("--status", choices=[s.value for s in JobStatus])
    ls.add_argument("--task")
    ls.add_argument("--queue")
    ls.add_argument("--limit", type=row_limit, default=100)
    ls.set_defaults(handler=cmd_jobs_list)
    show = verbs.add_parser("show", parents=parents, help="one job; exit 1 if not found")
    show.add_argument("id", type=int)
    show.set_defaults(handler=cmd_jobs_show)
    replay = verbs.add_parser("replay", parents=parents, help="make dead jobs pending again")
    retry = verbs.add_parser("retry", parents=parents, description="Deprecated: jobs replay.")
    for spelling, handler in ((replay, cmd_jobs_replay), (retry, cmd_jobs_retry)):
        spelling.add_argument("ids", type=int, nargs="*", metavar="ID")
        spelling.add_argument(
            "--dead", action="store_true", help="every dead job (or by task/queue)"
        )
        spelling.add_argument("--task")
        spelling.add_argument("--queue")
        spelling.set_defaults(handler=handler)
    cancel = verbs.add_parser(
        "cancel", parents=parents, help="cancel jobs: pending ones at once, running ones too"
    )
    cancel.add_argument("ids", type=int, nargs="+", metavar="ID")
    cancel.set_defaults(handler=cmd_jobs_cancel)
    purge = verbs.add_parser("purge", parents=parents, help="delete dead jobs in batches")
    purge.add_argument("--dead", action="store_true", required=True, help="purge dead jobs")
    purge.add_argument("--older-than", type=duration, metavar="DURATION", help="e.g. 7d")
    purge.set_defaults(handler=cmd_jobs_purge)


def _workflows_command(commands: _Commands, parents: _Parents) -> None:
    flows = commands.add_parser("workflows", help="list, show and cancel workflow runs")
    flow_verbs = flows.add_subparsers(title="actions", dest="action", required=True)
    fls = flow_verbs.add_parser("list", parents=parents, help="runs, newest first")
    fls.add_argument("--name", help="runs of this workflow name only")
    fls.add_argument("--limit", type=row_limit, default=50)
    fls.set_defaults(handler=cmd_workflows_list)
    fshow = flow_verbs.add_parser(
        "show", parents=parents, help="one run and its steps; exit 1 if not found"
    )
    fshow.add_argument("id", type=int)
    fshow.set_defaults(handler=cmd_workflows_show)
    fcancel = flow_verbs.add_parser(
        "cancel", parents=parents, help="cancel a run: waiting and pending steps, running ones"
    )
    fcancel.add_argument("id", type=int)
    fcancel.set_defaults(handler=cmd_workflows_cancel)


def _web_command(commands: _Commands, db: argparse.ArgumentParser) -> None:
    web = commands.add_parser(
        "web",
        parents=[db],
        help="serve the dashboard (needs aioq-pg[web])",
        description="Serve the dashboard until Ctrl-C: queues, workers, throughput, jobs. "
        "Read-only unless --actions; binds 127.0.0.1 unless --host says otherwise.",
    )
    web.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    web.add_argument("--port", type=port_number, default=8080, help="port (default: %(default)s)")
    web.add_argument(
        "--actions", action="store_true", help="allow replay, cancel and delete from the page"
    )
    web.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a host name the dashboard answers to, beyond --host and (on a loopback address)"
        " localhost: the name a proxy forwards; '.example.com' for a domain and its"
        " subdomains, '*' for any; repeat for more (other names get a 400: DNS rebinding)",
    )
    web.add_argument(
        "--refresh", type=duration, default=5.0, help="overview refresh, 0 = off (default: 5s)"
    )
    web.set_defaults(handler=cmd_web)


def _queues_command(commands: _Commands, parents: _Parents) -> None:
    queues = commands.add_parser(
        "queues", help="queue limits: list, set, pause, resume (obeyed by the whole fleet)"
    )
    steer = queues.add_subparsers(title="actions", dest="action", required=True)
    steer.add_parser(
        "list", parents=parents, help="queues with their limits, state and counts"
    ).set_defaults(handler=cmd_queues_list)
    limit = steer.add_parser(
        "set",
        parents=parents,
        help="set a queue's limits",
        description="Set the fleet-wide limits of queue NAME; running workers obey the new"
        " values without a restart. `none` removes a limit; what is not given stays.",
    )
    limit.add_argument("name", metavar="NAME")
    limit.add_argument(
        "--max-running",
        type=max_running,
        default=UNSET,
        metavar="N",
        help="jobs of the queue running at once across all workers (or none)",
    )
    limit.add_argument(
        "--max-running-per-key",
        type=max_running,
        default=UNSET,
        metavar="N",
        help="jobs of one concurrency key running at once across all workers; keys take"
        " turns (or none)",
    )
    limit.add_argument(
        "--rate",
        type=rate,
        default=UNSET,
        metavar="COUNT/DURATION",
        help="at most COUNT claims in any window of DURATION, e.g. 100/60s, 5/1m (or none)",
    )
    limit.set_defaults(handler=cmd_queues_set)
    for verb, handler, text in (
        ("pause", cmd_queues_pause, "stop claims of a queue fleet-wide; running jobs finish"),
        ("resume", cmd_queues_resume, "claim a paused queue again, at once"),
    ):
        action = steer.add_parser(verb, parents=parents, help=text)
        action.add_argument("name", metavar="NAME")
        action.set_defaults(handler=handler)


def _schedules_command(commands: _Commands, parents: _Parents) -> None:
    commands.add_parser(
        "schedules",
        parents=parents,
        help="periodic schedules with their last and next tick",
        description="List the @aioq.periodic schedules the workers have seen: the last tick"
        " enqueued (never, until the first one) and the next one.",
    ).set_defaults(handler=cmd_schedules)


def _defer_command(commands: _Commands, parents: _Parents) -> None:
    defer = commands.add_parser(
        "defer",
        parents=parents,
        help="enqueue a job by task name; print its id",
        description="Enqueue a job and print its id. Name the registry first (as for `aioq"
        " worker`) to use the task's own queue, priority, max_attempts and lease, with the"
        " flags overriding them, and to check the arguments against its signature. Without"
        " it the task's options are unknown: the job goes where the flags say.",
    )
    defer.add_argument("target", metavar="MODULE[:REGISTRY]", nargs="?")
    defer.add_argument("task", metavar="TASK")
    defer.add_argument("--args", default="{}", help="keyword arguments as a JSON object")
    defer.add_argument("--queue", help="default: the task's, else 'default'")
    defer.add_argument("--priority", type=int)
    defer.add_argument("--delay", type=duration)
    defer.add_argument("--max-attempts", type=positive_int)
    defer.add_argument("--lease", type=duration)
    defer.add_argument("--unique-key", help="return the live job with this key, if any")
    defer.set_defaults(handler=cmd_defer)
