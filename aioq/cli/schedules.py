"""``aioq schedules``: the periodic schedules the fleet has seen, with their last and next tick."""

from __future__ import annotations

import argparse
import dataclasses

import asyncpg

from aioq.cli.common import EXIT_OK, format_time, print_json, print_table, schema_from, with_db
from aioq.sql.schedules import LIST_SCHEDULES


def cmd_schedules(args: argparse.Namespace) -> int:
    """List schedules: name, task, queue, schedule, last tick enqueued (or never), next tick."""

    async def run(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
        rows = await LIST_SCHEDULES.rows(conn, schema_from(args))
        if args.json:
            print_json([dataclasses.asdict(row) for row in rows])
            return EXIT_OK
        print_table(
            ("NAME", "TASK", "QUEUE", "SCHEDULE", "LAST_TICK", "NEXT_TICK"),
            [
                (
                    row.name,
                    row.task,
                    row.queue,
                    row.spec,
                    format_time(row.last_tick) or "never",
                    format_time(row.next_tick),
                )
                for row in rows
            ],
        )
        return EXIT_OK

    return with_db(args, run)
