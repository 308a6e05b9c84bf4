"""The worker's command line mirrors Worker's retention options (to its --processes children
too), and its metrics endpoint stays on the host unless told otherwise."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from procs import aioq_cli, assert_one_line_error, children, spawner
from waits import wait_for

pytest.importorskip("prometheus_client")

# Jobs ended 2 hours and 10 minutes ago, dead, cancelled and archived.
SETUP = """
INSERT INTO aioq.jobs (id, task, status, run_at) OVERRIDING SYSTEM VALUE VALUES
    (1, 'old', 'dead', now() - interval '2 hours'),
    (2, 'young', 'dead', now() - interval '10 minutes'),
    (3, 'old', 'cancelled', now() - interval '2 hours');
INSERT INTO aioq.archive
    (id, queue, task, args, priority, attempts, max_attempts, created_at, started_at, finished_at)
VALUES
    (4, 'default', 'old', '{}', 0, 1, 5, now(), now(), now() - interval '2 hours'),
    (5, 'default', 'young', '{}', 0, 1, 5, now(), now(), now() - interval '10 minutes');
"""


def query(dsn: str, sql: str) -> Any:
    async def run() -> Any:
        conn = await asyncpg.connect(dsn)
        try:
            if ";" in sql:  # a script
                return await conn.execute(sql)
            return await conn.fetch(sql)
        finally:
            await conn.close()

    return asyncio.run(run())


def ids(dsn: str) -> list[int]:
    rows = query(dsn, "SELECT id FROM aioq.jobs UNION ALL SELECT id FROM aioq.archive ORDER BY 1")
    return [r["id"] for r in rows]


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    return stderr


@pytest.fixture
def app(dsn: str, tmp_path: Path) -> Path:
    (tmp_path / "tasks.py").write_text("import aioq\nregistry = aioq.Registry()\n")
    query(dsn, SETUP)
    return tmp_path


def test_dead_retention_prunes_on_every_child_and_none_keeps_the_archive(
    dsn: str, app: Path
) -> None:
    with spawner(dsn) as spawn:
        proc = spawn("worker", "tasks", "--processes", "2", "--dead-retention", "1h",
                     "--archive-retention", "none", cwd=app)  # fmt: skip
        wait_for(lambda: ids(dsn) == [2, 4, 5], "the old dead and cancelled jobs to go")
        wait_for(lambda: len(children(proc.pid)) == 2, "two children")
        for child in children(proc.pid):
            argv = Path(f"/proc/{child}/cmdline").read_text().split("\0")
            at = argv.index("--dead-retention")
            assert argv[at : at + 2] == ["--dead-retention", "3600.0"]
            at = argv.index("--archive-retention")
            assert argv[at : at + 2] == ["--archive-retention", "none"]
        stop(proc)
    assert ids(dsn) == [2, 4, 5]


def test_archive_retention_and_metrics_on_localhost(dsn: str, app: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with spawner(dsn) as spawn:
        proc = spawn("worker", "tasks", "--archive-retention", "30m", "--metrics-port",
                     str(port), cwd=app)  # fmt: skip
        wait_for(lambda: ids(dsn) == [1, 2, 3, 5], "the old archived job to go")
        assert listening(port) == ["127.0.0.1"]
        stderr = stop(proc)
    assert f"serving metrics on http://127.0.0.1:{port}/metrics" in stderr


def listening(port: int) -> list[str]:
    """The IPv4 addresses a TCP socket listens on at ``port`` (from /proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:
            found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@pytest.mark.parametrize("flag", ["--dead-retention", "--workflow-retention"])
def test_bad_retention_is_a_usage_error(dsn: str, app: Path, flag: str) -> None:
    assert_one_line_error(
        aioq_cli(dsn, "worker", "tasks", flag, "forever", cwd=app),
        flag,
        "'forever' is not a duration",
    )
