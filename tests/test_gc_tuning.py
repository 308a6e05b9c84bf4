"""`aioq worker` tunes the garbage collector of its own process; `--no-gc-tuning` leaves it alone;
the library's Worker never touches it."""

from __future__ import annotations

import gc
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import anyio
import asyncpg
import pytest
from procs import spawner
from waits import eventually

import aioq
from aioq.cli.worker import GC_GEN0_THRESHOLD

pytestmark = pytest.mark.anyio

HANG_GUARD = 30.0

TASKS = """
import gc, json, os

import aioq

registry = aioq.Registry()


@registry.task(name="report_gc")
async def report_gc(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}, f)
    os.replace(path + ".tmp", path)
"""


async def _reported(path: Path) -> bool:
    return await anyio.Path(path).exists()


@pytest.mark.parametrize("flags", [(), ("--no-gc-tuning",), ("--processes", "2")])
async def test_the_worker_command_tunes_its_own_gc(
    dsn: str, conn: asyncpg.Connection, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    (tmp_path / "gctasks.py").write_text(TASKS)
    report = tmp_path / "gc.json"
    task = aioq.Registry().task(name="report_gc")(_report_gc)
    with spawner(dsn) as spawn:
        proc = spawn("worker", "gctasks:registry", *flags, cwd=tmp_path, output=subprocess.DEVNULL)
        await task.defer(conn, path=str(report))
        await eventually(lambda: _reported(report), "the task to report", HANG_GUARD)
        proc.terminate()
        with anyio.fail_after(HANG_GUARD):
            await anyio.to_thread.run_sync(proc.wait)
    seen = json.loads(report.read_text())
    if "--no-gc-tuning" in flags:
        assert seen == {"threshold": list(gc.get_threshold()), "frozen": 0}
    else:  # a supervisor's children too
        assert seen["threshold"][0] == GC_GEN0_THRESHOLD
        assert seen["frozen"] > 1000  # the modules and the registry start-up allocated


async def _report_gc(path: str) -> None: ...


async def test_the_library_worker_leaves_the_gc_alone(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    ran = anyio.Event()

    @registry.task
    async def ping() -> None:
        ran.set()

    before = (gc.get_threshold(), gc.get_freeze_count(), gc.isenabled())
    async with make_worker():
        await ping.defer(conn)
        with anyio.fail_after(HANG_GUARD):
            await ran.wait()
        assert (gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()) == before
