"""Process helpers shared by the CLI tests and the chaos suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg
from waits import eventually

# The LISTEN connection of every worker process of this database; its worker id is host:pid:token.
LISTENERS = (
    "SELECT application_name FROM pg_stat_activity"
    " WHERE datname = current_database() AND application_name LIKE 'aioq listener %'"
)


def children(pid: int) -> set[int]:
    """The live pids whose parent is ``pid`` (a /proc scan)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.add(int(entry.name))
    return found


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a still-running ``aioq`` process and its children (test teardown), then reap it."""
    if proc.poll() is None:
        for child in children(proc.pid):
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.communicate()


def pid_of(worker_id: str) -> int:
    """The pid in a worker id (``host:pid:token``), or in an aioq connection's application name."""
    return int(worker_id.split(":")[-2])


AIOQ = str(Path(sys.executable).parent / "aioq")  # the console script pip installed


def aioq_cli(
    dsn: str | None, *args: str, cwd: Path | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run ``aioq ARGS`` as a user types it (the console script), AIOQ_DSN set or unset (None)."""
    env = {k: v for k, v in os.environ.items() if k != "AIOQ_DSN"}
    if dsn is not None:
        env["AIOQ_DSN"] = dsn
    return subprocess.run(
        [AIOQ, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


@contextmanager
def spawner(dsn: str) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Yield ``start(*args, cwd=, output=PIPE)``, which starts ``aioq ARGS`` (the console script)
    with AIOQ_DSN set; every process started, and its children, is killed on exit."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, cwd: Path, output: int = subprocess.PIPE) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [AIOQ, *args],
            env={**os.environ, "AIOQ_DSN": dsn},
            cwd=cwd,
            stdout=output,
            stderr=output,
            text=True,
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            kill_tree(proc)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Assert exit status 2 with one line on stderr, no traceback, containing ``fragments``."""
    assert result.returncode == 2, result
    message = result.stderr.strip()
    assert "Traceback" not in message, message
    assert len(message.splitlines()) == 1, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def fleet_of(dsn: str, cwd: Path, target: str) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Yield ``start(*args)``, which starts ``python -m aioq worker TARGET ARGS`` in ``cwd``
    (output to cwd/workers.log); at exit, each still running is stopped with SIGTERM, killed
    if it has not stopped within 30 s."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "aioq", "worker", target, *args]
        with (cwd / "workers.log").open("ab") as log:
            proc = subprocess.Popen(
                command, cwd=cwd, env={**os.environ, "AIOQ_DSN": dsn}, stdout=log, stderr=log
            )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def listening(conn: asyncpg.Connection, n: int) -> None:
    """Wait until ``n`` worker processes of this database have their LISTEN connection up."""

    async def count() -> bool:
        return len(await conn.fetch(LISTENERS)) == n

    await eventually(count)
