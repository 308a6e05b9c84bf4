"""``aioq dev`` and ``aioq worker``: a throwaway server, and workers under a supervisor."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import anyio

from aioq.cli.common import EXIT_OK, LISTEN_DSN_ENV, dsn_from, load_registry
from aioq.dev.server import EmbeddedPostgres
from aioq.supervisor import PROCESS_INDEX_ENV, Supervisor
from aioq.task import Registry
from aioq.worker import Worker

log = logging.getLogger("aioq.cli")


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
    dsn = dsn_from(args)
    registry = load_registry(args.target)  # in the supervisor too: a typo fails at once
    if args.processes > 1:
        return _supervise(args, dsn)
    return anyio.run(_work, args, dsn, registry)


def _supervise(args: argparse.Namespace, dsn: str) -> int:
    command = [sys.executable, "-m", "aioq", *(["--debug"] if args.debug else []), "worker"]
    command += [args.target, "--processes", "1", "--parent-pid", str(os.getpid())]
    command += ["--concurrency", str(args.concurrency), "--log-format", args.log_format]
    command += ["--log-level", args.log_level]
    command += ["--poll-interval", str(args.poll_interval)]
    command += ["--shutdown-grace", str(args.shutdown_grace)]
    command += ["--command-timeout", str(args.command_timeout)]
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
        queues=args.queue or None,  # None: every queue the registry's tasks name
        concurrency=args.concurrency,
        schema=args.schema or None,  # "" means unset, as in every command
        poll_interval=args.poll_interval,
        shutdown_grace=args.shutdown_grace,
        command_timeout=args.command_timeout,
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
