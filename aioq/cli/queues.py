"""``aioq queues``: list queues with their limits, set limits, pause and resume."""

from __future__ import annotations

import argparse
import dataclasses
import re

import asyncpg

from aioq import admin
from aioq.cli.common import EXIT_OK, duration, print_json, print_table, schema_from, with_db

_RATE = re.compile(r"^\s*(\d+)\s*/\s*(.+)$")


def rate(text: str) -> tuple[int, float] | None:
    """Parse ``100/60s`` (claims per duration), ``5/1m``, or ``none``."""
    if text.strip().lower() == "none":
        return None
    found = _RATE.fullmatch(text)
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate like 100/60s, 5/1m or none")
    return int(found[1]), duration(found[2])


def max_running(text: str) -> int | None:
    """Parse a count, or ``none``."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or none") from None


def _rate_text(value: tuple[int, float] | None) -> str:
    return f"{value[0]}/{value[1]:g}s" if value is not None else "-"


def _print(queues: list[admin.QueueInfo], as_json: bool) -> None:
    if as_json:
        print_json([dataclasses.asdict(q) for q in queues])
        return
    print_table(
        (
            "QUEUE",
            "STATE",
            "MAX_RUNNING",
            "RATE",
            "IN_WINDOW",
            "READY",
            "SCHEDULED",
            "RUNNING",
            "PER_KEY",
        ),
        [
            (
                q.name,
                "paused" if q.paused else "active",
                q.max_running if q.max_running is not None else "-",
                _rate_text(q.rate),
                q.window_claims if q.window_claims is not None else "-",
                q.ready,
                q.scheduled,
                q.running,
                q.max_running_per_key if q.max_running_per_key is not None else "-",
            )
            for q in queues
        ],
    )


def cmd_queues_list(args: argparse.Namespace) -> int:
    """List queues with settings or jobs: limits, state and counts."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        _print(await admin.queues(conn, schema=schema_from(args)), args.json)
        return EXIT_OK

    return with_db(args, run)


def _change(args: argparse.Namespace, **settings: object) -> int:
    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        info = await admin.set_queue(
            conn,
            args.name,
            schema=schema_from(args),
            **settings,  # type: ignore[arg-type]
        )
        _print([info], args.json)
        return EXIT_OK

    return with_db(args, run)


def cmd_queues_set(args: argparse.Namespace) -> int:
    """Set a queue's limits (``none`` removes one)."""
    settings: dict[str, object] = {}
    if args.max_running is not admin.UNSET:
        settings["max_running"] = args.max_running
    if args.rate is not admin.UNSET:
        settings["rate"] = args.rate
    if args.max_running_per_key is not admin.UNSET:
        settings["max_running_per_key"] = args.max_running_per_key
    return _change(args, **settings)


def cmd_queues_pause(args: argparse.Namespace) -> int:
    """Stop claims of a queue fleet-wide; running jobs finish."""
    return _change(args, paused=True)


def cmd_queues_resume(args: argparse.Namespace) -> int:
    """Let a paused queue be claimed again, at once."""
    return _change(args, paused=False)
