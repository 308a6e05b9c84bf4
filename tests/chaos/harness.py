"""The reliability (chaos) suite's one harness: profile, database, worker processes, faults.

Every scenario runs real worker processes (``python -m aioq worker``) against a real PostgreSQL
and observes them only through the database (and /proc); nothing sleeps to synchronise, it polls
with one hang guard (:func:`wait_for`). Scenarios 1-5 check the same invariants at the end
(:func:`check_drained`):

* every deferred job completed exactly once as far as the queue is concerned: the workers run
  with ``--keep-completed`` and ``archive.id`` is a primary key, so each job has one archive row;
* every job executed at least once: the tasks record each execution in ``chaos_runs`` on a
  connection of their own, straight to PostgreSQL (so the record survives a lost completion);
* nothing is left pending, running or dead;
* a job executed more than once was in flight at a fault (claimed, its outcome not yet written),
  and the duplicate executions are no more than the jobs in flight summed over the faults.

Profiles: ``AIOQ_CHAOS_PROFILE=quick`` (default, inside ``make test``) or ``long`` (``make chaos``).
Randomized scenarios take their seed from ``AIOQ_CHAOS_SEED`` (:func:`chaos_seed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import waits
from procs import LISTENERS, children, pid_of

from aioq.dev.pgbin import free_port, server_user

PROFILE = os.environ.get("AIOQ_CHAOS_PROFILE", "quick")
if PROFILE not in ("quick", "long"):
    raise ValueError(f"AIOQ_CHAOS_PROFILE must be quick or long, got {PROFILE!r}")
LONG = PROFILE == "long"

# Leases of the chaos tasks (set per row at defer): short, so a job whose worker died is
# rescued within seconds (the reaper runs every 5 s).
RECORD_LEASE = 3.0
STICKY_LEASE = 2.0
# Hang guards only: generous, since other test runs share the machine's two cores.
HANG_GUARD = 600.0 if LONG else 90.0  # a deadline for "never", not a timing
STOP_TIMEOUT = 60.0


def scaled(quick: int, long: int) -> int:
    """Pick the figure of the active profile."""
    return long if LONG else quick


def chaos_seed() -> int:
    """A random seed, or AIOQ_CHAOS_SEED to replay a failure (failures print their seed)."""
    given = os.environ.get("AIOQ_CHAOS_SEED")
    return int(given) if given else random.randrange(2**32)


TASKS = textwrap.dedent(
    '''
    """Tasks of the chaos suite: each execution is recorded in chaos_runs, on its own pool."""

    import asyncio
    import os
    import time
    import uuid

    import asyncpg

    import aioq

    registry = aioq.Registry()
    _pool = None
    _lock = None
    RECORD = (
        "INSERT INTO chaos_runs (token, job_id, attempt, worker_id, pid, started_at)"
        " VALUES ($1, $2, $3, $4, $5, to_timestamp($6)) ON CONFLICT (token) DO NOTHING"
    )


    async def _recorder():
        global _pool, _lock
        if _lock is None:
            _lock = asyncio.Lock()
        async with _lock:
            if _pool is None:
                _pool = await asyncpg.create_pool(
                    os.environ["CHAOS_RECORD_DSN"], min_size=0, max_size=4, command_timeout=5,
                    server_settings={"application_name": "chaos recorder"},
                )
        return _pool


    async def _record(started):
        """Insert one row for this execution, retrying through outages (the token dedups)."""
        job = aioq.current_job()
        token = uuid.uuid4()
        deadline = time.monotonic() + 120
        while True:
            try:
                pool = await _recorder()
                await pool.execute(
                    RECORD, token, job.id, job.attempt, job.worker_id, os.getpid(), started
                )
                return
            except Exception:  # any connection trouble (asyncpg raises a zoo of types)
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


    @registry.task(name="record", lease=3.0)
    async def record(sleep: float = 0.0) -> None:
        started = time.time()
        if sleep:
            await asyncio.sleep(sleep)
        await _record(started)


    @registry.task(name="sticky", lease=2.0)
    async def sticky(release: str, second: str = "") -> None:
        """The first attempt does its work, then holds on until the file ``release`` exists
        (and then returns without another round trip); with ``second``, the second attempt
        holds on until that file exists (heartbeated); later attempts just do the work."""
        await _record(time.time())
        hold = {1: release, 2: second}.get(aioq.current_job().attempt)
        if hold:
            while not os.path.exists(hold):
                await asyncio.sleep(0.05)
    '''
)

RUNS_DDL = """
CREATE TABLE chaos_runs (
    token uuid PRIMARY KEY,
    job_id bigint NOT NULL,
    attempt integer NOT NULL,
    worker_id text NOT NULL,
    pid integer NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


def log(message: str) -> None:
    """Print a progress line (shown with -s, and in the report of a failing test)."""
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Sql:
    """A blocking connection of the test's own (reconnects after a restart or termination)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._loop = asyncio.new_event_loop()
        self._conn: asyncpg.Connection | None = None

    def _run(self, make: Callable[[asyncpg.Connection], Any]) -> Any:
        async def go() -> Any:
            if self._conn is None or self._conn.is_closed():
                self._conn = await asyncpg.connect(
                    self.dsn, timeout=10, server_settings={"application_name": "chaos test"}
                )
            return await make(self._conn)

        return self._loop.run_until_complete(go())

    def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        result: list[asyncpg.Record] = self._run(lambda c: c.fetch(query, *args, timeout=30))
        return result

    def value(self, query: str, *args: Any) -> Any:
        return self._run(lambda c: c.fetchval(query, *args, timeout=30))

    def execute(self, query: str, *args: Any) -> None:
        self._run(lambda c: c.execute(query, *args, timeout=30))

    def retrying(self, call: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``call`` until the server answers (it may be restarting)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return call()
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                if time.monotonic() > deadline:
                    raise
                self._drop()
                time.sleep(0.1)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._loop.run_until_complete(self._conn.close(timeout=5))
            except Exception:
                self._conn.terminate()
            self._conn = None
        self._loop.close()


def wait_for(
    predicate: Callable[[], object],
    what: str,
    timeout: float = HANG_GUARD,
    *,
    on_timeout: Callable[[], str] = lambda: "",
) -> float:
    """The tests' one sync wait (``tests/waits.py``) with the chaos suite's hang guard."""
    return waits.wait_for(predicate, what, timeout, on_timeout=on_timeout)


def fetch(dsn: str, statement: str, *args: Any) -> list[asyncpg.Record]:
    """Run one statement on a connection of its own and return its rows."""
    sql = Sql(dsn)
    try:
        return sql.fetch(statement, *args)
    finally:
        sql.close()


def value(dsn: str, statement: str, *args: Any) -> Any:
    """Run one statement and return the first column of its first row."""
    rows = fetch(dsn, statement, *args)
    return rows[0][0] if rows else None


def with_user(dsn: str, user: str, password: str | None = None) -> str:
    """Return ``dsn`` logging in as another role."""
    parts = urlsplit(dsn)
    auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    host = parts.hostname or "127.0.0.1"
    netloc = f"{auth}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def prepare(sql: Sql, workdir: Path) -> None:
    """Create the executions table and write the tasks module into ``workdir``."""
    sql.execute(RUNS_DDL)
    (workdir / "chaostasks.py").write_text(TASKS)


def defer(
    sql: Sql, count: int, *, max_sleep: float = 0.02, lease: float = RECORD_LEASE
) -> list[int]:
    """Defer ``count`` record jobs sleeping up to ``max_sleep`` each; return their ids."""
    rows = sql.fetch(
        "INSERT INTO aioq.jobs (task, args, lease)"
        " SELECT 'record', jsonb_build_object('sleep', round((random() * $2)::numeric, 4)),"
        "        make_interval(secs => $3)"
        " FROM generate_series(1, $1) RETURNING id",
        count,
        max_sleep,
        lease,
    )
    return [r["id"] for r in rows]


def defer_sticky(sql: Sql, release: Path, second: Path | None = None) -> int:
    """Defer one sticky job (short lease; its first attempt waits for ``release`` to exist,
    its second for ``second`` when given)."""
    job_id: int = sql.value(
        "INSERT INTO aioq.jobs (task, args, lease)"
        " VALUES ('sticky', jsonb_build_object('release', $1::text, 'second', $3::text),"
        " make_interval(secs => $2))"
        " RETURNING id",
        str(release),
        STICKY_LEASE,
        "" if second is None else str(second),
    )
    return job_id


def listening_pids(sql: Sql) -> set[int]:
    """Pids of worker processes whose LISTEN connection is up."""
    return {pid_of(r[0]) for r in sql.fetch(LISTENERS)}


def backends_of(sql: Sql, pid: int) -> int:
    """How many server connections the worker process ``pid`` holds."""
    count: int = sql.value(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'aioq %' AND split_part(application_name, ':', 2) = $1",
        str(pid),
    )
    return count


def busy_backends_of(sql: Sql, pid: int) -> int:
    """How many server connections of worker process ``pid`` are running a statement."""
    count: int = sql.value(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'aioq %' AND split_part(application_name, ':', 2) = $1"
        " AND state <> 'idle'",
        str(pid),
    )
    return count


def running_ids(sql: Sql, pid: int | None = None) -> set[int]:
    """Ids of running jobs (of worker process ``pid``, or of anyone)."""
    rows = sql.fetch(
        "SELECT id, locked_by FROM aioq.jobs WHERE status = 'running'",
    )
    return {r["id"] for r in rows if pid is None or pid_of(r["locked_by"]) == pid}


def archived(sql: Sql) -> int:
    count: int = sql.value("SELECT count(*) FROM aioq.archive")
    return count


def pending(sql: Sql) -> int:
    count: int = sql.value("SELECT count(*) FROM aioq.jobs WHERE status = 'pending'")
    return count


def first_completion_after(sql: Sql, when: float) -> float | None:
    """Seconds from ``when`` (epoch) to the first job archived after it, if any."""
    at = datetime.fromtimestamp(when, UTC)
    first: datetime | None = sql.value(
        "SELECT min(finished_at) FROM aioq.archive WHERE finished_at > $1", at
    )
    return None if first is None else (first - at).total_seconds()


class WorkerProcess:
    """``python -m aioq worker TARGET ARGS`` (a supervisor and its children with ``--processes
    N``), its output in a log file; killed on exit from ``with`` if still running."""

    def __init__(
        self,
        target: str,
        *args: str,
        dsn: str,
        cwd: Path,
        env: Mapping[str, str] | None = None,
        processes: int = 1,
    ) -> None:
        self.command = [sys.executable, "-m", "aioq", "worker", target, *args]
        self.cwd = cwd
        self.env = {**os.environ, **(env or {}), "AIOQ_DSN": dsn}
        self.processes = processes
        self.log_path = cwd / f"worker-{secrets.token_hex(3)}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.stopped: set[int] = set()  # SIGSTOPped pids, continued before a stop

    def start(self) -> Self:
        with self.log_path.open("wb") as log:  # a file, not a pipe: nobody must have to drain it
            self.proc = subprocess.Popen(
                self.command,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> set[int]:
        return children(self.pid)

    def workers(self) -> set[int]:
        """The pids of the processes that run jobs: the children, or this one alone."""
        return children(self.pid) or {self.pid}

    def records(self) -> list[dict[str, Any]]:
        """The JSON log lines (``--log-format json``) of the process and its children so far."""
        out = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def messages(self, pid: int | None = None) -> list[str]:
        return [r["message"] for r in self.records() if pid is None or r.get("process") == pid]

    def assert_alive(self) -> None:
        assert self.proc is not None
        assert self.proc.poll() is None, f"the worker exited ({self.proc.returncode})"

    def wait_listening(self, dsn: str, processes: int | None = None) -> set[int]:
        """Wait until the workers have their LISTEN connection open; return their pids."""
        expected = self.processes if processes is None else processes
        sql = Sql(dsn)

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the worker exited with {self.proc.returncode}:\n{self.log()}"
                )
            pids = children(self.pid) if expected > 1 else {self.pid}
            return len(pids) == expected and listening_pids(sql) >= pids

        try:
            wait_for(ready, f"{expected} worker process(es) listening", on_timeout=self.log)
        finally:
            sql.close()
        return self.workers()

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM (graceful) and wait; return the exit status."""
        assert self.proc is not None
        for pid in self.stopped:
            _signal(pid, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"the worker ignored SIGTERM:\n{self.log()}") from None
        self.returncode = self.proc.returncode
        return self.returncode

    def kill(self) -> None:
        """Tear down whatever is left (cleanup after a failure)."""
        if self.proc is not None and self.proc.poll() is None:
            for pid in children(self.pid):
                _signal(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(30)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def spawn_fleet(
    workdir: Path,
    dsn: str,
    *,
    record_dsn: str | None = None,
    processes: int = 3,
    concurrency: int = 10,
    extra: Sequence[str] = (),
    target: str = "chaostasks:registry",
) -> WorkerProcess:
    """Start ``aioq worker TARGET --processes N`` (chaostasks:registry) on ``dsn`` (AIOQ_DSN)."""
    args = ["--processes", str(processes), "--concurrency", str(concurrency)]
    args += ["--poll-interval", "0.2", "--shutdown-grace", "2", "--keep-completed"]
    args += ["--log-format", "json", *extra]
    env = {"CHAOS_RECORD_DSN": record_dsn or dsn}
    fleet = WorkerProcess(target, *args, dsn=dsn, cwd=workdir, env=env, processes=processes)
    return fleet.start()


def wait_serving(fleet: WorkerProcess, sql: Sql) -> set[int]:
    """Wait until all of a fleet's children run and LISTEN; return their pids."""
    return fleet.wait_listening(sql.dsn)


def lease_lost_reports(fleet: WorkerProcess, sql: Sql) -> dict[str, int]:
    """Count the workers' "lease lost before its outcome was written" warnings, and how many
    were spurious: the same worker's completion of that attempt is in the archive (its write
    committed, the reply was lost with the connection, and the retried write found nothing)."""
    reports = [
        (r["job_id"], r["process"], r["attempt"])
        for r in fleet.records()
        if r.get("outcome") == "lease_lost" and "before its outcome" in r["message"]
    ]
    spurious = 0
    for job, pid, attempt in reports:
        row = sql.fetch("SELECT worker, attempts FROM aioq.archive WHERE id = $1", job)
        if row and pid_of(row[0]["worker"]) == pid and row[0]["attempts"] == attempt:
            spurious += 1
    # Outcomes the completer could not confirm (its write may have committed before the
    # connection dropped): logged at INFO, not as a lost lease.
    unconfirmed = sum(1 for r in fleet.records() if r.get("outcome") == "unconfirmed")
    return {"lease_lost_warnings": len(reports), "spurious": spurious, "unconfirmed": unconfirmed}


@dataclass
class Fault:
    """One injected fault: when, and which jobs were in flight then (may run again)."""

    started: float  # epoch seconds
    ended: float
    in_flight: set[int]
    note: str = ""


@dataclass
class Result:
    """What a scenario observed; printed and, with AIOQ_CHAOS_REPORT, appended as JSON."""

    scenario: str
    jobs: int
    processes: int
    concurrency: int
    faults: int
    lost: int
    duplicates: int
    duplicate_bound: int
    recover_s: list[float]
    wall_s: float
    notes: dict[str, Any] = field(default_factory=dict)

    def report(self) -> None:
        recover = (
            f"max {max(self.recover_s):.2f}s median {sorted(self.recover_s)[len(self.recover_s) // 2]:.2f}s"
            if self.recover_s
            else "n/a"
        )
        log(
            f"RESULT {self.scenario} [{PROFILE}]: {self.jobs} jobs, {self.processes}x"
            f"{self.concurrency}, {self.faults} faults, lost {self.lost}, duplicates"
            f" {self.duplicates} (bound {self.duplicate_bound}), recover {recover},"
            f" wall {self.wall_s:.1f}s {self.notes}"
        )
        path = os.environ.get("AIOQ_CHAOS_REPORT")
        if path:
            with open(path, "a") as out:
                out.write(json.dumps({"profile": PROFILE, **self.__dict__}) + "\n")


def check_drained(
    sql: Sql, job_ids: Iterable[int], faults: Sequence[Fault], fleet: WorkerProcess | None = None
) -> tuple[int, int, int]:
    """Assert the suite's invariants; return (lost, duplicate executions, duplicate bound).

    With ``fleet``, the workers' log lines about repeated jobs are printed too.
    """
    ids = set(job_ids)
    left = sql.fetch("SELECT id, status, attempts, locked_by FROM aioq.jobs ORDER BY id LIMIT 20")
    assert not left, f"jobs left in the table: {[dict(r) for r in left]}"
    archive = sql.fetch("SELECT id FROM aioq.archive")
    archived_ids = [r["id"] for r in archive]
    # archive.id is the primary key, so a job can be completed once at most.
    assert len(archived_ids) == len(set(archived_ids))
    lost = ids - set(archived_ids)
    assert not lost, f"{len(lost)} jobs never completed: {sorted(lost)[:20]}"
    assert set(archived_ids) == ids, "the archive holds jobs nobody deferred"
    runs = sql.fetch("SELECT job_id, count(*) AS n FROM chaos_runs GROUP BY job_id")
    executed = {r["job_id"]: r["n"] for r in runs}
    never = ids - executed.keys()
    assert not never, f"{len(never)} jobs completed but never executed: {sorted(never)[:20]}"
    repeated = {job: n - 1 for job, n in executed.items() if n > 1}
    in_flight = set().union(*(f.in_flight for f in faults)) if faults else set()
    unexplained = set(repeated) - in_flight
    assert not unexplained, (
        f"jobs executed more than once without being in flight at a fault: {sorted(unexplained)}"
    )
    bound = sum(len(f.in_flight) for f in faults)
    duplicates = sum(repeated.values())
    if repeated:
        detail = sql.fetch(
            "SELECT job_id, attempt, pid, started_at, finished_at FROM chaos_runs"
            " WHERE job_id = ANY($1) ORDER BY job_id, finished_at LIMIT 30",
            sorted(repeated),
        )
        log("repeated executions (job, attempt, pid, started, finished):")
        for r in detail:
            log(f"  {r[0]} {r[1]} {r[2]} {r[3]:%H:%M:%S.%f} {r[4]:%H:%M:%S.%f}")
        for fault in faults:
            log(f"  fault {fault.note} at {datetime.fromtimestamp(fault.started):%H:%M:%S.%f}")
        if fleet is not None:
            for record in fleet.records():
                if record.get("job_id") in repeated and record.get("outcome") != "succeeded":
                    log(f"  {record}")
    assert duplicates <= bound, f"{duplicates} duplicate executions > {bound} jobs in flight"
    return len(lost), duplicates, bound


# --- a TCP proxy that can cut or stall the network between workers and PostgreSQL ---


class _Link:
    """One proxied connection: client <-> upstream."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.writers = (client, upstream)
        self.frozen = False  # blackholed: bytes are read from neither side, nothing is closed
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class Proxy:
    """A TCP proxy on 127.0.0.1 in a thread of its own, with faults on demand.

    * :meth:`drop_all` closes every connection (both sides see a reset);
    * :meth:`stall` stops forwarding bytes, on all connections and new ones, for N seconds;
    * :meth:`blackhole` freezes the current connections for good (they stay open, nothing
      passes, as when a NAT or firewall forgets them) while new connections work.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._links: set[_Link] = set()
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self.accepted = 0

    def __enter__(self) -> Proxy:
        self._thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for link in list(self._links):
            link.abort()
        self._links.clear()
        await asyncio.sleep(0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        link.tasks = [
            asyncio.ensure_future(self._pump(link, reader, up_writer)),
            asyncio.ensure_future(self._pump(link, up_reader, writer)),
        ]
        try:
            await asyncio.gather(*link.tasks, return_exceptions=True)
        finally:
            link.abort()
            self._links.discard(link)

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        assert self._flowing is not None
        try:
            while True:
                await self._flowing.wait()
                if link.frozen:
                    await asyncio.Future()  # until aborted
                data = await reader.read(65536)
                if not data:
                    break
                await self._flowing.wait()
                if link.frozen:
                    await asyncio.Future()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            link.abort()

    def connections(self) -> int:
        return len(self._links)

    def drop_all(self) -> int:
        """Abort every proxied connection; return how many."""

        async def drop() -> int:
            links = list(self._links)
            for link in links:
                link.abort()
            return len(links)

        dropped: int = self._call(drop())
        return dropped

    def stall(self, seconds: float) -> None:
        """Forward nothing (on any connection, old or new) for ``seconds``; returns at once."""

        async def pause() -> None:
            assert self._flowing is not None
            self._flowing.clear()
            self._loop.call_later(seconds, self._flowing.set)

        self._call(pause())

    def flowing(self) -> bool:
        assert self._flowing is not None
        return self._flowing.is_set()

    def blackhole(self) -> int:
        """Freeze every current connection for good; return how many."""

        async def freeze() -> int:
            for link in self._links:
                link.frozen = True
            return len(self._links)

        frozen: int = self._call(freeze())
        return frozen


def jitter(seconds: float) -> float:
    return seconds * random.uniform(0.8, 1.2)


# --- scenarios 6-10: a tasks module per scenario, recording outcomes--------------------------------------------------

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
