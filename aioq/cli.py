"""The ``aioq`` command line.

Each subcommand is one ``_cmd_<name>(args) -> int`` function registered in
:func:`_build_parser`. Errors derived from :class:`~aioq.errors.AioqError` print
one line and exit with status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

__all__ = ("main",)

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence

import anyio

from aioq.errors import AioqError
from aioq.server import EmbeddedPostgres

log = logging.getLogger("aioq.cli")

EXIT_ERROR = 2

_Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``aioq`` command line and return its exit status."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    handler: _Handler = args.handler
    try:
        return handler(args)
    except AioqError as exc:
        if args.debug:
            raise
        print(f"aioq: error: {exc.message}", file=sys.stderr)
        return EXIT_ERROR


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aioq", description="An asyncio job queue on PostgreSQL.")
    parser.add_argument(
        "--debug", action="store_true", help="log at DEBUG and show tracebacks of errors"
    )
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
    return parser


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
