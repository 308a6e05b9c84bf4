"""Shared pieces of the reliability (chaos) suite.

Every scenario runs real worker processes (``python -m aioq worker --processes N``) against a
real PostgreSQL, injects faults, and checks the same invariants at the end (:func:`check_drained`):

* every deferred job completed exactly once as far as the queue is concerned: the workers run
  with ``--keep-completed`` and ``archive.id`` is a primary key, so each job has one archive row;
* every job executed at least once: the tasks record each execution in ``chaos_runs`` on a
  connection of their own, straight to PostgreSQL (so the record survives a lost completion);
* nothing is left pending, running or dead;
* a job executed more than once was in flight at a fault (claimed, its outcome not yet written),
  and the duplicate executions are no more than the jobs in flight summed over the faults.

Profiles: ``AIOQ_CHAOS_PROFILE=quick`` (default, inside ``make test``) or ``long`` (``make chaos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from procs import LISTENERS, children, pid_of

PROFILE = os.environ.get("AIOQ_CHAOS_PROFILE", "quick")
if PROFILE not in ("quick", "long"):
    raise ValueError(f"AIOQ_CHAOS_PROFILE must be quick or long, got {PROFILE!r}")
LONG = PROFILE == "long"

# Leases of the chaos tasks (set per row at defer): short, so a job whose worker died is
# rescued within seconds (the reaper runs every 5 s).
RECORD_LEASE = 3.0
STICKY_LEASE = 2.0
HANG_GUARD = 600.0 if LONG else 90.0  # generous: a deadline for "never", not a timing

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
    async def sticky(release: str) -> None:
        """The first attempt does its work, then holds on until the file ``release`` exists
        (and then returns without another round trip); later attempts just do the work."""
        await _record(time.time())
        if aioq.current_job().attempt == 1:
            while not os.path.exists(release):
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


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = HANG_GUARD) -> float:
    """Poll ``predicate`` until true; return the seconds waited; fail after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - started


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


def defer_sticky(sql: Sql, release: Path) -> int:
    """Defer one sticky job (short lease; its first attempt waits for ``release`` to exist)."""
    job_id: int = sql.value(
        "INSERT INTO aioq.jobs (task, args, lease)"
        " VALUES ('sticky', jsonb_build_object('release', $1::text), make_interval(secs => $2))"
        " RETURNING id",
        str(release),
        STICKY_LEASE,
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


@dataclass
class Fleet:
    """A supervisor (``aioq worker --processes N``) and its log file."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    processes: int
    stopped: set[int] = field(default_factory=set)  # SIGSTOPped pids, continued on cleanup

    @property
    def pid(self) -> int:
        return self.proc.pid

    def children(self) -> set[int]:
        return children(self.proc.pid)

    def records(self) -> list[dict[str, Any]]:
        """The JSON log lines of the supervisor and all its children so far."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def messages(self, pid: int | None = None) -> list[str]:
        return [r["message"] for r in self.records() if pid is None or r.get("process") == pid]

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"the supervisor exited ({self.proc.returncode})"

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the supervisor (graceful) and return its exit status."""
        for pid in self.stopped:
            _signal(pid, signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """Tear down whatever is left (cleanup after a failure)."""
        if self.proc.poll() is None:
            for pid in self.children():
                _signal(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(timeout=30)


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
) -> Fleet:
    """Start ``aioq worker chaostasks:registry --processes N`` on ``dsn`` (AIOQ_DSN)."""
    command = [sys.executable, "-m", "aioq", "worker", target]
    command += ["--processes", str(processes), "--concurrency", str(concurrency)]
    command += ["--poll-interval", "0.2", "--shutdown-grace", "2", "--keep-completed"]
    command += ["--log-format", "json", *extra]
    env = {**os.environ, "AIOQ_DSN": dsn, "CHAOS_RECORD_DSN": record_dsn or dsn}
    log_path = workdir / f"workers-{len(list(workdir.glob('workers-*.log')))}.log"
    with log_path.open("wb") as out:  # a file, not a pipe: nobody must have to drain it
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=out)
    return Fleet(proc, log_path, processes)


def wait_serving(fleet: Fleet, sql: Sql) -> set[int]:
    """Wait until all children run and LISTEN; return their pids."""

    def ready() -> bool:
        fleet.assert_alive()
        kids = fleet.children()
        return len(kids) == fleet.processes and kids <= listening_pids(sql)

    wait_for(ready, f"{fleet.processes} workers listening", timeout=60)
    return fleet.children()


def lease_lost_reports(fleet: Fleet, sql: Sql) -> dict[str, int]:
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
    sql: Sql, job_ids: Iterable[int], faults: Sequence[Fault], fleet: Fleet | None = None
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
