"""What the ``aioq`` commands share: exit codes, argument types, the database, output."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import anyio
import asyncpg

from aioq.errors import AioqError
from aioq.job import Job
from aioq.registry import Registry, default_registry
from aioq.sql import DEFAULT_SCHEMA

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2
LISTEN_DSN_ENV = "AIOQ_LISTEN_DSN"
CLOSE_TIMEOUT = 5.0  # seconds an interrupted command waits for its connection to close

DbCommand = Callable[[asyncpg.Connection, argparse.Namespace], Awaitable[int]]


class UsageError(Exception):
    """A bad command line or environment: one line on stderr, exit status 2."""


_DURATION = re.compile(r"^(\d+(?:\.\d*)?)\s*(s|m|h|d)?$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """Parse ``30``, ``30s``, ``15m``, ``2h`` or ``7d`` into seconds."""
    found = _DURATION.fullmatch(text.strip())
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30s, 15m, 2h, 7d")
    return float(found[1]) * _UNITS[found[2] or "s"]


def port_number(text: str) -> int:
    """Parse a TCP port, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (1 to 65535)")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


MAX_LIMIT = 2**63 - 1
"""The most rows a ``--limit`` may ask for: PostgreSQL's LIMIT is a bigint."""


def row_limit(text: str) -> int:
    """Parse a ``--limit``: a number of rows, 1 to :data:`MAX_LIMIT`."""
    value = positive_int(text)
    if value > MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_LIMIT}, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def dsn_from(args: argparse.Namespace) -> str:
    dsn: str | None = args.dsn or os.environ.get("AIOQ_DSN")
    if not dsn:
        raise UsageError(
            "no database: pass --dsn or set AIOQ_DSN"
            " (aioq dev starts a throwaway PostgreSQL and prints one)"
        )
    return dsn


def schema_from(args: argparse.Namespace) -> str:
    return args.schema or DEFAULT_SCHEMA


def with_db(args: argparse.Namespace, command: DbCommand) -> int:
    dsn = dsn_from(args)

    async def run() -> int:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            return await command(conn, args)
        finally:
            await conn.close()

    return anyio.run(run)


def until_interrupted(args: argparse.Namespace, command: DbCommand) -> int:
    """Run a command that repeats until SIGINT (Ctrl-C) or SIGTERM; either ends it with 0.

    The command's own handlers, installed before anything else runs: asyncio's would cancel
    the main task once (a cancellation a library may absorb), is installed only when SIGINT
    has Python's default handler (so never when the shell started the command with SIGINT
    ignored, as it does for a background job), and leaves windows where the signal raises
    KeyboardInterrupt in the middle of setting the event loop up or cancels a task that
    then escapes as CancelledError. Here a signal at any point cancels one scope around the
    connect and the command, a cancellation that stays in force until the scope exits.
    """
    dsn = dsn_from(args)
    interrupted = False
    scope: anyio.CancelScope | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def on_signal(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True
        if loop is not None:
            loop.set_exception_handler(_quiet_after_interrupt)
        if scope is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to stop
                loop.call_soon_threadsafe(scope.cancel)  # in the loop, and wakes it up

    async def run() -> int:
        nonlocal scope, loop
        with anyio.CancelScope() as scope:
            loop = asyncio.get_running_loop()
            if interrupted:  # before the loop ran
                scope.cancel()
            conn = await asyncpg.connect(dsn, timeout=10)
            try:
                return await command(conn, args)
            finally:
                # A statement cut short is cancelled on the server too (a backend blocked on
                # a lock would not notice its client left), within a bound.
                with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
                    await conn.close()
                if not conn.is_closed():
                    conn.terminate()
        return EXIT_OK

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return anyio.run(run)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _quiet_after_interrupt(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Drop the network errors of what the interrupt cut short, report anything else.

    A connect cancelled before the server answered leaves asyncpg a future whose connection
    error nobody reads; asyncio would log it as an ERROR on the way out.
    """
    if isinstance(context.get("exception"), OSError):
        return
    loop.default_exception_handler(context)


def use_django(args: argparse.Namespace) -> None:
    """Set up the Django project of ``--django``: its DSN and schema become the defaults."""
    try:
        from aioq.contrib.django.project import setup
    except ImportError as exc:
        raise UsageError(f"--django needs Django ({exc}): pip install 'aioq-pg[django]'") from None
    sys.path.insert(0, os.getcwd())  # the project's package, as manage.py finds it
    try:
        project = setup(args.django, args.tasks_backend)
    except AioqError:
        raise
    except Exception as exc:
        raise UsageError(
            f"cannot set up Django with {args.django!r}: {type(exc).__name__}: {exc}"
        ) from exc
    args.django_project = project
    if hasattr(args, "dsn") and not args.dsn and not os.environ.get("AIOQ_DSN"):
        args.dsn = project.dsn
    if hasattr(args, "schema") and not args.schema:
        args.schema = project.schema


def load_registry(target: str) -> Registry:
    """Import ``MODULE[:REGISTRY]`` (the current directory first) and return its registry."""
    module_name, _, attribute = target.partition(":")
    if not module_name:
        raise UsageError(f"{target!r}: expected MODULE or MODULE:REGISTRY")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UsageError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    if getattr(module, "__file__", None) is None and hasattr(module, "__path__"):
        # A directory without __init__.py, which Python imports as an empty namespace package
        # (say ./app beside the app.py you meant): it defines no task and no registry.
        where = ", ".join(str(path) for path in module.__path__)
        raise UsageError(
            f"{module_name!r} imported the directory {where} (it has no __init__.py), not a"
            f" module of tasks: run aioq from the directory that holds"
            f" {module_name.rpartition('.')[2]}.py (the current one comes first on sys.path)"
        )
    if attribute:
        if not hasattr(module, attribute):
            raise UsageError(
                f"module {module_name!r} has no attribute {attribute!r}"
                " (MODULE:REGISTRY names the aioq.Registry defined in MODULE)"
            )
        registry = getattr(module, attribute)
        if not isinstance(registry, Registry):
            raise UsageError(
                f"{module_name}:{attribute} is not an aioq.Registry"
                f" (its type is {type(registry).__name__})"
            )
        return registry
    found = getattr(module, "registry", None)
    return found if isinstance(found, Registry) else default_registry


def job_dict(job: Job) -> dict[str, Any]:
    values = dataclasses.asdict(job)
    values["status"] = job.status.value
    values["args"] = json.loads(job.args)
    if job.result is not None:  # the stored return value, decoded like args
        values["result"] = json.loads(job.result)
    return values


def print_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=_json_default))


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        print("(none)")


def format_time(value: datetime | None) -> str:
    return f"{value.astimezone(UTC):%Y-%m-%d %H:%M:%SZ}" if value is not None else ""


def format_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_ints(values: Sequence[int]) -> str:
    return " ".join(str(v) for v in values)


def counted(n: int, noun: str) -> str:
    """``1 job``, ``2 jobs``: a count and its noun (plural by an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
