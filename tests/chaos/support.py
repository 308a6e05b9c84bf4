"""What the chaos scenarios 6-10 share: the profile, worker processes, PgBouncer, polling.

Scenarios run real ``python -m aioq worker`` processes against the test database and observe
them only through the database (and /proc); they never sleep to synchronise, they poll with a
deadline. ``AIOQ_CHAOS_PROFILE=long`` (``make chaos``) raises the loads.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
from procs import LISTENERS, children, pid_of

from aioq.dev.pgbin import free_port, server_user

PROFILE = os.environ.get("AIOQ_CHAOS_PROFILE", "quick")
LONG = PROFILE == "long"

# Hang guards only: generous, since other test runs share the machine's two cores.
HANG_GUARD = 120.0 if LONG else 60.0
STOP_TIMEOUT = 60.0


def scaled(quick: int, long: int) -> int:
    """Pick the figure of the active profile."""
    return long if LONG else quick


def chaos_seed() -> int:
    """A random seed, or AIOQ_CHAOS_SEED to replay a failure (failures print their seed)."""
    given = os.environ.get("AIOQ_CHAOS_SEED")
    return int(given) if given else random.randrange(2**32)


# --- the database, from synchronous test code ------------------------------------------------


def with_user(dsn: str, user: str, password: str | None = None) -> str:
    """Return ``dsn`` logging in as another role."""
    parts = urlsplit(dsn)
    auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    host = parts.hostname or "127.0.0.1"
    netloc = f"{auth}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def _fetch(dsn: str, statement: str, args: Sequence[Any]) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(statement, *args)
    finally:
        await conn.close()


def fetch(dsn: str, statement: str, *args: Any) -> list[asyncpg.Record]:
    """Run one statement on a connection of its own and return its rows."""
    return asyncio.run(_fetch(dsn, statement, args))


def value(dsn: str, statement: str, *args: Any) -> Any:
    """Run one statement and return the first column of its first row."""
    rows = fetch(dsn, statement, *args)
    return rows[0][0] if rows else None


def wait_for(
    predicate: Callable[[], object],
    what: str,
    *,
    on_timeout: Callable[[], str] = lambda: "",
) -> None:
    """Poll ``predicate`` until it is true; fail naming ``what`` after the hang guard.

    ``on_timeout`` adds context to that failure, e.g. a worker's log (its tail).
    """
    deadline = time.monotonic() + HANG_GUARD
    while not predicate():
        if time.monotonic() > deadline:
            tail = on_timeout()[-4000:]
            raise AssertionError(f"timed out after {HANG_GUARD:g}s waiting for {what}\n{tail}")
        time.sleep(0.1)


async def until(predicate: Callable[[], object], what: str) -> None:
    """The async ``wait_for``: poll ``predicate`` in the running event loop."""
    try:
        async with asyncio.timeout(HANG_GUARD):
            while not predicate():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out after {HANG_GUARD:g}s waiting for {what}") from None


# --- a tasks module for the worker processes ---------------------------------------------------

RUNS_TABLE = """
CREATE TABLE IF NOT EXISTS public.chaos_runs (
    job_id bigint NOT NULL,
    attempt integer NOT NULL,
    worker_id text NOT NULL,
    outcome text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

# Tasks record each execution in chaos_runs through CHAOS_RECORD_DSN (a direct connection that is
# not under test), one pool per worker process.
RECORDER = textwrap.dedent(
    '''
    import asyncio
    import os

    import asyncpg

    import aioq

    _pool = None
    _lock = asyncio.Lock()


    async def recorder() -> asyncpg.Pool:
        """This process's pool on CHAOS_RECORD_DSN."""
        global _pool
        async with _lock:
            if _pool is None:
                _pool = await asyncpg.create_pool(
                    os.environ["CHAOS_RECORD_DSN"], min_size=1, max_size=4
                )
        return _pool


    async def record(outcome: str) -> None:
        """Insert (job id, attempt, worker, outcome) for the running job."""
        job = aioq.current_job()
        await (await recorder()).execute(
            "INSERT INTO public.chaos_runs (job_id, attempt, worker_id, outcome)"
            " VALUES ($1, $2, $3, $4)",
            job.id,
            job.attempt,
            job.worker_id,
            outcome,
        )
    '''
)


def write_tasks(directory: Path, name: str, body: str) -> str:
    """Write a tasks module (the recorder plus ``body``) and return its module name."""
    (directory / f"{name}.py").write_text(RECORDER + textwrap.dedent(body))
    return name


def run_counts(dsn: str, outcome: str = "ok") -> dict[int, int]:
    """How many times each job id was recorded with ``outcome``."""
    rows = fetch(
        dsn,
        "SELECT job_id, count(*) FROM public.chaos_runs WHERE outcome = $1 GROUP BY job_id",
        outcome,
    )
    return {r[0]: r[1] for r in rows}


def run_times(dsn: str, outcome: str = "ok") -> dict[int, datetime]:
    """When each job id was first recorded with ``outcome`` (database time)."""
    rows = fetch(
        dsn,
        "SELECT job_id, min(at) FROM public.chaos_runs WHERE outcome = $1 GROUP BY job_id",
        outcome,
    )
    return {r[0]: r[1] for r in rows}


def db_now(dsn: str) -> datetime:
    """The database's clock (the one run times are recorded with)."""
    now: datetime = value(dsn, "SELECT clock_timestamp()")
    return now


# --- worker processes ----------------------------------------------------------------------


class WorkerProcess:
    """``python -m aioq worker TARGET ARGS`` with its output in a log file; stopped on exit."""

    def __init__(
        self,
        target: str,
        *args: str,
        dsn: str,
        cwd: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.command = [sys.executable, "-m", "aioq", "worker", target, *args]
        self.cwd = cwd
        self.env = {**os.environ, **(env or {}), "AIOQ_DSN": dsn}
        self.log_path = cwd / f"worker-{secrets.token_hex(3)}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    def __enter__(self) -> Self:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def workers(self) -> set[int]:
        """The pids of the processes that run jobs: the children, or this one alone."""
        return children(self.pid) or {self.pid}

    def wait_listening(self, dsn: str, processes: int = 1) -> set[int]:
        """Wait until ``processes`` workers have their LISTEN connection open; return their pids."""

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the worker exited with {self.proc.returncode}:\n{self.log()}"
                )
            pids = children(self.pid) if processes > 1 else {self.pid}
            return len(pids) == processes and {pid_of(r[0]) for r in fetch(dsn, LISTENERS)} >= pids

        wait_for(ready, f"{processes} worker process(es) listening", on_timeout=self.log)
        return self.workers()

    def stop(self) -> int:
        """SIGTERM (graceful) and wait; return the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self._kill()
                raise AssertionError(f"the worker ignored SIGTERM:\n{self.log()}") from None
        self.returncode = self.proc.returncode
        return self.returncode

    def _kill(self) -> None:
        assert self.proc is not None
        for child in children(self.pid):
            with suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._kill()


# --- sockets of a process (who holds which TCP connection) ---------------------------------


def tcp_connections(pid: int) -> set[tuple[int, int]]:
    """(local port, remote port) of each TCP connection process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                local, remote = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
                found.add((local, remote))
    return found


# --- PgBouncer -----------------------------------------------------------------------------


def find_pgbouncer() -> str | None:
    """The pgbouncer binary on PATH or in /usr/sbin (Debian's package), if any."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    fallback = Path("/usr/sbin/pgbouncer")
    return str(fallback) if os.access(fallback, os.X_OK) else None


class PgBouncer:
    """A PgBouncer of our own in transaction mode, on a free port, in front of ``server_dsn``.

    ``databases`` maps the names clients use to databases on the server; any other name is
    passed through. As root it runs as an unprivileged OS user, which owns its files.
    """

    def __init__(
        self,
        binary: str,
        server_dsn: str,
        *,
        databases: Mapping[str, str],
        users: Sequence[str],
        pool_size: int = 3,
    ) -> None:
        self.binary = binary
        self.server = urlsplit(server_dsn)
        self.databases = dict(databases)
        self.users = list(users)
        self.pool_size = pool_size
        self.port = 0
        self.pid = 0
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def dsn(self, database: str, user: str | None = None) -> str:
        """A DSN for ``database`` through this PgBouncer."""
        role = quote(user or self.server.username or "postgres", safe="")
        return f"postgresql://{role}@127.0.0.1:{self.port}/{quote(database, safe='')}"

    def _config(self) -> str:
        host = self.server.hostname or "127.0.0.1"
        server = f"host={host} port={self.server.port or 5432}"
        if self.server.password:
            server += f" password={self.server.password}"
        aliases = "".join(
            f"{alias} = {server} dbname={real}\n" for alias, real in self.databases.items()
        )
        return (
            "[databases]\n"
            f"{aliases}"
            f"* = {server}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self._dir}/userlist.txt\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 500\n"
            "server_login_retry = 1\n"
            "ignore_startup_parameters = extra_float_digits\n"
        )

    def start(self) -> None:
        """Write the config, start PgBouncer and wait until it accepts a client."""
        user = server_user()  # as root, the same unprivileged user as the embedded server
        self._dir = Path(tempfile.mkdtemp(prefix="aioq-pgbouncer-"))
        os.chmod(self._dir, 0o755)
        (self._dir / "userlist.txt").write_text("".join(f'"{u}" ""\n' for u in self.users))
        for attempt in range(3):
            self.port = free_port()
            ini = self._dir / "pgbouncer.ini"
            ini.write_text(self._config())
            log_path = self._dir / "pgbouncer.log"
            if user is not None:
                for path in (self._dir, self._dir / "userlist.txt", ini):
                    os.chown(path, user.uid, user.gid)
            with log_path.open("wb") as log:
                self._proc = subprocess.Popen(
                    [self.binary, str(ini)],
                    cwd=self._dir,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    user=user.uid if user else None,
                    group=user.gid if user else None,
                    extra_groups=[] if user else None,
                )
            self.pid = self._proc.pid
            if self._wait_ready():
                return
            self._terminate()
            if "Address already in use" not in self.log() or attempt == 2:
                break
        raise RuntimeError(f"pgbouncer did not start:\n{self.log()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 30
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    def log(self) -> str:
        if self._dir is None:
            return ""
        try:
            return (self._dir / "pgbouncer.log").read_text(errors="replace")
        except OSError:
            return ""

    def _terminate(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGINT)  # safe shutdown: waits for clients to finish
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextmanager
def role(admin_dsn: str, dsn: str, prefix: str = "aioq_app") -> Iterator[tuple[str, str]]:
    """A LOGIN role of this test's own with no privileges; yield (its name, a DSN as it)."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    password = secrets.token_hex(8)
    fetch(admin_dsn, f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
    try:
        yield name, with_user(dsn, name, password)
    finally:
        # Privileges live in the test's database; the role is cluster-wide.
        fetch(dsn, f"DROP OWNED BY {name}")
        fetch(admin_dsn, f"DROP ROLE {name}")
