"""An embedded, throwaway PostgreSQL server for the demo and the tests.

:class:`EmbeddedPostgres` runs ``initdb`` in a fresh temporary directory, starts
a server that listens only on 127.0.0.1 (its unix socket lives in the same
directory), and on stop shuts it down and deletes the directory. The binaries
come from :func:`find_binaries`.

PostgreSQL refuses to run as root, so as root the server runs as the OS user
``postgres`` (or ``nobody``) and the temporary directory is given to that user.
"""

from __future__ import annotations

__all__ = ("EmbeddedPostgres", "find_binaries")

import atexit
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

import anyio

from aioq.dev.pgbin import (
    HOST,
    SUPERUSER,
    OsUser,
    accepts_connections,
    check_reachable,
    find_binaries,
    free_port,
    pid_alive,
    server_user,
)
from aioq.errors import ConfigError, ServerError

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0
INITDB_TIMEOUT = 120.0
MAX_CONNECTIONS = 200
LOG_TAIL_LINES = 20
PORT_ATTEMPTS = 3

_T = TypeVar("_T")


class EmbeddedPostgres:
    """A throwaway PostgreSQL server in a temporary directory, deleted on stop."""

    def __init__(
        self,
        *,
        fsync: bool = True,
        port: int | None = None,
        search_path: Sequence[str | os.PathLike[str]] | None = None,
        standby_of: EmbeddedPostgres | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ConfigError("port", f"must be between 1 and 65535, got {port}")
        if standby_of is not None and search_path is None:
            search_path = (standby_of.bin_dir,)  # the primary's PostgreSQL: a base backup needs it
        self._fsync = fsync
        self._standby_of = standby_of
        self._settings = dict(settings or {})
        self._requested_port = port
        self._search_path = None if search_path is None else tuple(search_path)
        self._lock = threading.RLock()
        self._user: OsUser | None = None
        self._root: Path | None = None  # set while there is something to tear down
        self._bin_dir: Path | None = None
        self._data_dir: Path | None = None
        self._port: int | None = None

    @property
    def dsn(self) -> str:
        """The connection string, e.g. ``postgresql://postgres@127.0.0.1:54321/postgres``."""
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/postgres"

    @property
    def port(self) -> int:
        """The TCP port the server listens on, on 127.0.0.1."""
        return self._require(self._port)

    @property
    def data_dir(self) -> Path:
        """The server's data directory (deleted on stop)."""
        return self._require(self._data_dir)

    @property
    def bin_dir(self) -> Path:
        """The directory holding the initdb and pg_ctl in use."""
        return self._require(self._bin_dir)

    @staticmethod
    def _require(value: _T | None) -> _T:
        if value is None:
            raise ServerError("the embedded PostgreSQL server has not been started")
        return value

    def start(self) -> None:
        """Create a data directory, run initdb, start the server and wait until it is ready."""
        with self._lock:
            if self._root is not None:
                raise ServerError("the embedded PostgreSQL server is already started")
            self._bin_dir = find_binaries(self._search_path)
            self._user = server_user()
            self._root = Path(tempfile.mkdtemp(prefix="aioq-pg-"))
            atexit.register(self._stop_at_exit)
            try:
                self._start()
            except BaseException:
                self.stop()
                raise

    def _start(self) -> None:
        root = self._require(self._root)
        if self._user is not None:
            check_reachable(
                self.bin_dir, self._user, "install PostgreSQL where any user can run it"
            )
            os.chown(root, self._user.uid, self._user.gid)
            check_reachable(root, self._user, "set TMPDIR to a directory like /tmp")
        os.chmod(root, 0o700)
        self._data_dir = root / "data"
        if self._standby_of is not None:
            self._base_backup(self._standby_of)
        else:
            self._initdb()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._port = self._requested_port or free_port()
            result = self._run(self._pg_ctl("start"), timeout=START_TIMEOUT + 10)
            # Another process can take a port picked here before the server binds it.
            tail = self._log_tail() if result.returncode else ""
            clash = "could not bind" in tail or "already in use" in tail
            if result.returncode == 0 or self._requested_port or not clash:
                break
            log.debug("port %d was taken (attempt %d), trying another", self._port, attempt)
        self._check("pg_ctl start", result)
        self._wait_ready()
        log.info(
            "started PostgreSQL at %s (data in %s, run as %s)",
            self.dsn,
            self._data_dir,
            self._user.name if self._user else "the current user",
        )

    def _initdb(self) -> None:
        initdb = [
            str(self.bin_dir / "initdb"),
            "-D", str(self.data_dir),
            "--auth=trust", "-U", SUPERUSER, "-E", "UTF8", "--no-locale",
        ]  # fmt: skip
        if not self._fsync:
            initdb.append("--no-sync")
        self._check("initdb", self._run(initdb, timeout=INITDB_TIMEOUT))

    def _base_backup(self, primary: EmbeddedPostgres) -> None:
        """Copy a running primary into our data directory, set up to stream from it (-R)."""
        backup = [
            str(self.bin_dir / "pg_basebackup"),
            "-h", HOST, "-p", str(primary.port), "-U", SUPERUSER,
            "-D", str(self.data_dir), "-X", "stream", "-R", "--checkpoint=fast",
        ]  # fmt: skip
        if not self._fsync:
            backup.append("--no-sync")
        self._check("pg_basebackup", self._run(backup, timeout=INITDB_TIMEOUT))

    def promote(self) -> None:
        """Promote this standby to a primary (``pg_ctl promote``) and wait until it accepts writes."""
        with self._lock:
            command = [
                str(self.bin_dir / "pg_ctl"), "promote", "-D", str(self.data_dir),
                "-w", "-t", f"{START_TIMEOUT:g}", "-s",
            ]  # fmt: skip
            self._check("pg_ctl promote", self._run(command, timeout=START_TIMEOUT + 10))
            log.info("promoted PostgreSQL at %s to primary", self.dsn)

    def kill(self) -> None:
        """SIGKILL the server and its backends at once, as a crash would (``stop`` cleans up)."""
        with self._lock:
            pid = self._postmaster_pid()
            if pid is not None:
                self._kill(pid)
                log.info("killed PostgreSQL postmaster %d (port %s)", pid, self._port)

    def restart(self) -> None:
        """Restart the server (``pg_ctl restart -m fast``) and wait until it is ready again."""
        with self._lock:
            if self._root is None:
                raise ServerError("the embedded PostgreSQL server is not running")
            result = self._run(self._pg_ctl("restart", "-m", "fast"), timeout=2 * START_TIMEOUT)
            self._check("pg_ctl restart", result)
            self._wait_ready()
            log.info("restarted PostgreSQL at %s", self.dsn)

    def stop(self) -> None:
        """Stop the server and delete its directory; calling it again does nothing."""
        with self._lock:
            root = self._root
            if root is None:
                return
            atexit.unregister(self._stop_at_exit)
            try:
                self._shutdown()
            finally:
                self._root = None
                shutil.rmtree(root, ignore_errors=True)
                if root.exists():
                    log.warning("could not delete %s", root)
                else:
                    log.debug("deleted %s", root)

    def _shutdown(self) -> None:
        pid = self._postmaster_pid()
        if pid is None:
            return  # initdb failed or the server never got as far as its pid file
        if not pid_alive(pid):
            return  # killed (kill()): nothing to stop
        for mode in ("fast", "immediate"):
            command = [
                str(self.bin_dir / "pg_ctl"), "stop", "-D", str(self.data_dir),
                "-m", mode, "-w", "-t", f"{STOP_TIMEOUT:g}", "-s",
            ]  # fmt: skip
            try:
                result = self._run(command, timeout=STOP_TIMEOUT + 10)
            except ServerError as exc:
                log.warning("%s", exc)
                continue
            if result.returncode == 0:
                break
            log.warning("pg_ctl stop -m %s failed: %s", mode, result.stderr.strip())
        if pid_alive(pid):
            log.warning("killing PostgreSQL postmaster %d", pid)
            self._kill(pid)
        else:
            log.info("stopped PostgreSQL on port %s", self._port)

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            # The postmaster leads its own process group, which holds its backends.
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_TIMEOUT
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _stop_at_exit(self) -> None:
        try:
            self.stop()
        except Exception:
            log.exception("could not stop the embedded PostgreSQL server at exit")

    def _pg_ctl(self, action: str, *extra: str) -> list[str]:
        root = self._require(self._root)
        options = [
            "-h", HOST, "-p", str(self.port), "-k", str(root),
            "-c", f"max_connections={MAX_CONNECTIONS}",
        ]  # fmt: skip
        if not self._fsync:
            options += ["-c", "fsync=off", "-c", "synchronous_commit=off"]
            options += ["-c", "full_page_writes=off"]
        for name, value in self._settings.items():  # after the defaults: the last one wins
            options += ["-c", f"{name}={value}"]
        return [
            str(self.bin_dir / "pg_ctl"), action, *extra,
            "-D", str(self.data_dir), "-l", str(root / "postgres.log"),
            "-w", "-t", f"{START_TIMEOUT:g}", "-s",
            "-o", shlex.join(options),
        ]  # fmt: skip

    def _run(self, command: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL program as the server's user, out of reach of a terminal's Ctrl-C."""
        # Our PG* variables (PGDATA, PGPORT, ...) are meant for clients, not for this server.
        env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
        user = self._user
        log.debug("running %s", shlex.join(command))
        try:
            return subprocess.run(
                command,
                cwd=self._root,  # an inherited cwd may be unreadable by the server's user
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                start_new_session=True,
                user=user.uid if user else None,
                group=user.gid if user else None,
                extra_groups=[] if user else None,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"{command[0]} did not finish within {timeout:g}s") from exc
        except OSError as exc:
            as_user = f" as OS user {user.name!r}" if user else ""
            raise ServerError(f"cannot run {command[0]}{as_user}: {exc}") from exc

    def _check(self, what: str, result: subprocess.CompletedProcess[str]) -> None:
        if result.returncode != 0:
            output = (result.stderr or result.stdout).strip()
            tail = self._log_tail()
            raise ServerError(
                f"{what} failed (exit {result.returncode}): {output}"
                + (f"\n--- server log tail ---\n{tail}" if tail else "")
            )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not accepts_connections(self.port):
            if time.monotonic() > deadline:
                raise ServerError(
                    f"PostgreSQL did not accept connections on port {self.port} within "
                    f"{START_TIMEOUT:g}s\n--- server log tail ---\n{self._log_tail()}"
                )
            time.sleep(0.05)

    def _log_tail(self) -> str:
        if self._root is None:
            return ""
        try:
            lines = (self._root / "postgres.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def _postmaster_pid(self) -> int | None:
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first)
        except (OSError, ValueError, ServerError):
            return None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        try:
            await anyio.to_thread.run_sync(self.start)
        except BaseException:
            # Cancelled while start() ran in its thread: it finished, so undo it.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)
