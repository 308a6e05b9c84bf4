"""``aioq dev`` and ``aioq worker``: a throwaway server, and workers under a supervisor."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import asyncpg

from aioq.cli.common import (
    EXIT_OK,
    LISTEN_DSN_ENV,
    UsageError,
    dsn_from,
    duration,
    load_registry,
    non_negative_int,
    positive_int,
)
from aioq.dev.server import EmbeddedPostgres
from aioq.errors import ConfigError
from aioq.migrate import check_installed
from aioq.registry import Registry, default_registry
from aioq.sql import quote_schema
from aioq.supervisor import PROCESS_INDEX_ENV, Supervisor
from aioq.worker import (
    DEFAULT_ARCHIVE_RETENTION,
    DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONCURRENCY,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_PREFETCH,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_UNKNOWN_TASK_GRACE,
    DEFAULT_WORKFLOW_RETENTION,
    Worker,
    WorkerConfig,
)
from aioq.worker.health import serve_health
from aioq.worker.history import DEFAULT_STATS_RETENTION

log = logging.getLogger("aioq.cli")

# Metrics stay on the host unless asked for (--metrics-addr 0.0.0.0), as the health probes do.
DEFAULT_METRICS_ADDR = "127.0.0.1"

# `aioq worker` tunes the garbage collector of its own process (the library's Worker never
# touches process-wide settings): what start-up allocated (modules, the registry, the
# configuration) is frozen out of every collection, and the youngest generation is collected
# after this many allocations instead of 700 (a job allocates a few dozen container objects,
# so the default ran a collection every few dozen jobs). --no-gc-tuning leaves both alone.
GC_GEN0_THRESHOLD = 50_000


def tune_gc() -> None:
    """Freeze what start-up allocated and collect the youngest generation less often."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


@dataclass(frozen=True, slots=True)
class _Flag:
    """A worker option: its flag, the WorkerConfig field it sets (also its argparse dest)."""

    flag: str
    field: str
    type: Callable[[str], Any] | None  # None: a switch
    default: Any
    help: str | None = None


def _prefetch(text: str) -> int | str:
    return text if text == "auto" else non_negative_int(text)


def _retention(text: str) -> float | None:
    """Parse a retention: a duration (``7d``, ``12h``, ``0``), or ``none`` to keep rows forever."""
    return None if text.strip().lower() == "none" else duration(text)


def _arg(value: object) -> str:
    """A flag's value as its parser reads it back (a child's command line)."""
    return "none" if value is None else str(value)


# The worker's options, written once: the parser, the argv of the supervisor's children and
# the Worker(...) call are all built from this table.
WORKER_FLAGS = (
    _Flag("--concurrency", "concurrency", positive_int, DEFAULT_CONCURRENCY),
    _Flag("--poll-interval", "poll_interval", duration, DEFAULT_POLL_INTERVAL),
    _Flag(
        "--prefetch",
        "prefetch",
        _prefetch,
        DEFAULT_PREFETCH,
        "jobs claimed ahead of free consumers: 'auto' (what they start within one claim round"
        " trip), N, or 0 (default: %(default)s)",
    ),
    _Flag("--shutdown-grace", "shutdown_grace", duration, DEFAULT_SHUTDOWN_GRACE),
    _Flag(
        "--command-timeout",
        "command_timeout",
        duration,
        DEFAULT_COMMAND_TIMEOUT,
        "seconds before a statement on a silent connection gives up (default: %(default)g)",
    ),
    _Flag(
        "--keep-completed",
        "keep_completed",
        None,
        False,
        "move finished jobs to the archive table instead of deleting them",
    ),
    _Flag(
        "--archive-retention",
        "archive_retention",
        _retention,
        DEFAULT_ARCHIVE_RETENTION,
        "prune jobs kept by --keep-completed this long after they finished, e.g. 7d, or none"
        " to keep them (default: 7d)",
    ),
    _Flag(
        "--dead-retention",
        "dead_retention",
        _retention,
        None,
        "prune dead and cancelled jobs this long after they were last due, e.g. 30d, or none"
        " (default: none, kept until `aioq jobs purge`)",
    ),
    _Flag(
        "--workflow-retention",
        "workflow_retention",
        _retention,
        DEFAULT_WORKFLOW_RETENTION,
        "prune a workflow run's steps and results this long after it was deferred, once none"
        " of its steps is left in the jobs table, e.g. 7d, or none (default: 1d)",
    ),
    _Flag(
        "--stats-retention",
        "stats_retention",
        duration,
        DEFAULT_STATS_RETENTION,
        "keep the per-minute history of `aioq stats` and the dashboard this long (default: 2d)",
    ),
    _Flag(
        "--no-statement-cache",
        "statement_cache",
        None,
        True,
        "no prepared statements on the pool (PgBouncer in transaction mode)",
    ),
    _Flag(
        "--unknown-task-grace",
        "unknown_task_grace",
        duration,
        DEFAULT_UNKNOWN_TASK_GRACE,
        "how long a job whose task this worker does not know waits for a worker that knows it"
        " (a deploy in progress), its attempts unspent, before it is dead, e.g. 1h, or 0"
        " (default: 1h)",
    ),
    _Flag(
        "--no-periodic",
        "periodic",
        None,
        True,
        "do not enqueue the ticks of the registry's @aioq.periodic schedules",
    ),
)


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """Add the options of :data:`WORKER_FLAGS` to the worker's parser."""
    for f in WORKER_FLAGS:
        if f.type is None:  # a switch flips its default
            action = "store_false" if f.default else "store_true"
            parser.add_argument(f.flag, dest=f.field, action=action, help=f.help)
        else:
            parser.add_argument(f.flag, dest=f.field, type=f.type, default=f.default, help=f.help)


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The options of :data:`WORKER_FLAGS` as given, for a child's command line."""
    argv: list[str] = []
    for f in WORKER_FLAGS:
        value = getattr(args, f.field)
        if f.type is None:
            argv += [f.flag] if value != f.default else []
        else:
            argv += [f.flag, _arg(value)]
    return argv


def _worker_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of :data:`WORKER_FLAGS` as WorkerConfig fields, checked by WorkerConfig.

    A value it refuses is a usage error naming the flag, raised before anything starts: under
    a supervisor, each child would fail on it and be restarted forever.
    """
    options = {f.field: getattr(args, f.field) for f in WORKER_FLAGS}
    try:
        WorkerConfig(**options)
    except ConfigError as exc:
        flags = {f.field: f.flag for f in WORKER_FLAGS}
        raise UsageError(f"argument {flags[exc.field]}: {exc.problem}") from None
    return options


def cmd_dev(args: argparse.Namespace) -> int:
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


def cmd_worker(args: argparse.Namespace) -> int:
    """Run a worker, or ``--processes`` of them under a supervisor."""
    options = _worker_options(args)
    if args.worker_id is not None and not args.worker_id.strip():
        raise UsageError("argument --worker-id: must not be empty")
    if args.schema:  # refused before the module loads and warns about what it holds
        quote_schema(args.schema)
    dsn = dsn_from(args)
    project = getattr(args, "django_project", None)
    if args.target is None and project is None:
        raise UsageError("the following arguments are required: MODULE[:REGISTRY]")
    # In the supervisor too: a typo fails at once.
    registry = load_registry(args.target) if args.target else default_registry
    if project is not None:  # its Django tasks too, and its aioq backends' queues
        from aioq.contrib.django.project import served

        registry = project.registry(registry)
        args.queue = served(project, registry, args.queue)
    elif not len(registry) and args.parent_pid is None:  # once, not in every child
        log.warning(
            "%s registers no tasks: every job this worker claims waits for a worker that knows"
            " its task, then is dead with UnknownTaskError"
            " (name the module that defines them, or one that imports it)",
            args.target,
        )
    if args.processes > 1:
        # Children would each fail on a missing schema and be restarted forever: check first.
        anyio.run(_check_schema, dsn, args.schema or registry.schema)
        return _supervise(args, dsn)
    return anyio.run(_work, args, dsn, registry, options)


def _ports_fit(flag: str, port: int, processes: int) -> None:
    """Refuse a port that child ``processes - 1`` would run past 65535 with (one per child)."""
    if port + processes - 1 > 65535:
        raise UsageError(f"argument {flag}: {port} + {processes} processes runs past port 65535")


async def _check_schema(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn, timeout=10, statement_cache_size=0)  # PgBouncer-safe
    try:
        await check_installed(conn, schema)
    finally:
        await conn.close()


def _supervise(args: argparse.Namespace, dsn: str) -> int:
    command = [sys.executable, "-m", "aioq", *(["--debug"] if args.debug else [])]
    if args.django:
        command += ["--django", args.django]
        command += ["--tasks-backend", args.tasks_backend] if args.tasks_backend else []
    command += ["worker", *([args.target] if args.target else [])]
    command += ["--processes", "1", "--parent-pid", str(os.getpid())]
    command += ["--log-format", args.log_format, "--log-level", args.log_level]
    command += [] if args.gc_tuning else ["--no-gc-tuning"]
    command += _worker_argv(args)
    if args.metrics_port is not None:
        _ports_fit("--metrics-port", args.metrics_port, args.processes)
        command += ["--metrics-port", str(args.metrics_port), "--metrics-addr", args.metrics_addr]
    if args.health_port is not None:  # each child adds its index (one port per process)
        _ports_fit("--health-port", args.health_port, args.processes)
        command += ["--health-port", str(args.health_port), "--health-addr", args.health_addr]
    for queue in args.queue or ():
        command += ["--queue", queue]
    if args.schema:
        command += ["--schema", args.schema]
    if args.worker_id:  # each child adds its index (one id per process)
        command += ["--worker-id", args.worker_id]
    # The DSN goes through the environment, not argv, where `ps` would show a password.
    env = {**os.environ, "AIOQ_DSN": dsn}
    if args.listen_dsn:
        env[LISTEN_DSN_ENV] = args.listen_dsn
    return Supervisor(command, args.processes, env=env).run()


async def _work(
    args: argparse.Namespace, dsn: str, registry: Registry, options: dict[str, Any]
) -> int:
    metrics = None
    if args.metrics_port is not None:
        from aioq import metrics as aioq_metrics  # only now: prometheus_client is optional

        port = args.metrics_port + int(os.environ.get(PROCESS_INDEX_ENV, "0"))
        try:
            metrics = aioq_metrics.start(port, args.metrics_addr)
        except OSError as exc:  # the port, not the database: say so (as --health-port does)
            raise UsageError(
                f"argument --metrics-port: cannot serve on {args.metrics_addr}:{port}:"
                f" {exc.strerror or exc}"
            ) from None
        log.info("serving metrics on http://%s:%d/metrics", args.metrics_addr, port)
    if args.worker_id:
        index = os.environ.get(PROCESS_INDEX_ENV) if args.parent_pid is not None else None
        options["worker_id"] = args.worker_id if index is None else f"{args.worker_id}-{index}"
    worker = Worker(
        dsn=dsn,
        registry=registry,
        metrics=metrics,
        queues=args.queue or None,  # None: every queue the registry's tasks name
        schema=args.schema or None,  # "" means unset, as in every command
        listen_dsn=args.listen_dsn or os.environ.get(LISTEN_DSN_ENV) or None,
        **options,
    )
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        # A supervisor starts its children with these blocked (see Supervisor._start): a
        # signal held back while we imported is delivered now, to the receiver.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
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
            if args.health_port is not None:
                port = args.health_port + int(os.environ.get(PROCESS_INDEX_ENV, "0"))
                try:
                    await tg.start(serve_health, worker.health, args.health_addr, port)
                except OSError as exc:
                    raise UsageError(
                        f"argument --health-port: cannot serve on {args.health_addr}:{port}:"
                        f" {exc.strerror or exc}"
                    ) from None
            if args.parent_pid is not None:
                tg.start_soon(_watch_parent, worker, args.parent_pid)
            if args.gc_tuning:
                tune_gc()
            await worker.run()
            tg.cancel_scope.cancel()
    return EXIT_OK


async def _watch_parent(worker: Worker, parent_pid: int) -> None:
    """Stop gracefully if the supervisor dies (we are then re-parented)."""
    while os.getppid() == parent_pid:  # noqa: ASYNC110 (no event tells us; poll)
        await anyio.sleep(1.0)
    log.warning("supervisor %d is gone: stopping", parent_pid)
    worker.stop()
