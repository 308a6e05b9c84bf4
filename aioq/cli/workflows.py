"""``aioq workflows``: list, show and cancel workflow runs from a shell."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import asyncpg

from aioq import admin
from aioq.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    format_ints,
    format_time,
    print_json,
    print_table,
    schema_from,
    with_db,
)
from aioq.workflows import workflow as get_workflow

_COUNTS = ("waiting", "pending", "running", "succeeded", "dead", "cancelled")


def cmd_workflows_list(args: argparse.Namespace) -> int:
    """List workflow runs, newest first, with their steps counted by status."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        runs = await admin.list_workflows(
            conn, name=args.name, limit=args.limit, schema=schema_from(args)
        )
        if args.json:
            print_json([dataclasses.asdict(r) | {"steps": sum(r.counts.values())} for r in runs])
            return EXIT_OK
        rows = [
            (r.id, r.name, r.state, format_time(r.created_at), *(r.count_text(c) for c in _COUNTS))
            for r in runs
        ]
        headers = ("ID", "NAME", "STATE", "CREATED_AT", *(c.upper() for c in _COUNTS))
        print_table(headers, rows)
        return EXIT_OK

    return with_db(args, run)


def cmd_workflows_show(args: argparse.Namespace) -> int:
    """Show one run and its steps (name, job id, status, dependencies); exit 1 if not found."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        info = await get_workflow(conn, args.id, schema=schema_from(args))
        if info is None:
            print(f"aioq: workflow {args.id} not found (pruned, or never existed)", file=sys.stderr)
            return EXIT_FAILED
        if args.json:
            print_json(dataclasses.asdict(info))
            return EXIT_OK
        counts = ", ".join(f"{n} {c}" for c, n in info.counts.items() if n)
        print(f"workflow {info.id} {info.name}: {info.state} ({counts})")
        print(f"created_at: {format_time(info.created_at)}")
        rows = [
            (
                s.name,
                s.job_id,
                s.task,
                s.status,
                _after(s.after),
                (s.last_error or "").split("\n", 1)[0][:60],
            )
            for s in info.steps
        ]
        print_table(("STEP", "JOB", "TASK", "STATUS", "AFTER", "LAST_ERROR"), rows)
        return EXIT_OK

    return with_db(args, run)


_AFTER_SHOWN = 3
"""Dependencies a step's row names in `workflows show`; a fan-in's others are counted."""


def _after(names: list[str]) -> str:
    """A step's dependencies for the table: a fan-in of 50 would make every row 700 wide."""
    if len(names) <= _AFTER_SHOWN:
        return ",".join(names) or "-"
    return ",".join(names[:_AFTER_SHOWN]) + f" +{len(names) - _AFTER_SHOWN} more"


def cmd_workflows_cancel(args: argparse.Namespace) -> int:
    """Cancel a run's steps that may still run; exit 1 if the run does not exist."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        schema = schema_from(args)
        info = await get_workflow(conn, args.id, schema=schema)
        if info is None:
            print(f"aioq: workflow {args.id} not found (pruned, or never existed)", file=sys.stderr)
            return EXIT_FAILED
        states = await admin.cancel_workflow(conn, args.id, schema=schema)
        if not states and not args.json:  # every step had ended: say how the run ended
            print(
                f"workflow {args.id}: nothing left to cancel, every step ended (run {info.state})"
            )
            return EXIT_OK
        by_state: dict[str, list[int]] = {}
        for job_id, state in states.items():
            by_state.setdefault(state, []).append(job_id)
        if args.json:
            print_json({"workflow": args.id, **by_state})
            return EXIT_OK
        cancelled = by_state.get("cancelled", [])
        print(f"workflow {args.id}: cancelled {len(cancelled)} steps" + (
            f": {format_ints(cancelled)}" if cancelled else ""))  # fmt: skip
        if by_state.get("cancelling"):
            running = by_state["cancelling"]
            print(f"cancelling {len(running)} running steps: {format_ints(running)}")
        return EXIT_OK

    return with_db(args, run)
