"""Health probes: Worker.health(), the /livez and /readyz server, aioq worker --health-port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import asyncpg
import pytest
from procs import AIOQ, aioq_cli, assert_one_line_error, kill_tree
from waits import eventually

import aioq
from aioq.worker import DEFAULT_SHUTDOWN_GRACE
from aioq.worker import health as health_module
from aioq.worker.health import (
    MAX_CONNECTIONS,
    STALE_AFTER,
    Health,
    Probe,
    judge_health,
    serve_health,
)
from aioq.worker.run import MIN_FINAL_WRITE

MakeWorker = Callable[..., aioq.Worker]


async def get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, object]]:
    """One HTTP/1.0 request to 127.0.0.1:port; the status and the JSON body ({} if none)."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"{method} {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        with anyio.fail_after(10):
            try:
                while True:
                    data += await stream.receive()
            except anyio.EndOfStream:
                pass
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body) if body else {}


def start(command: list[str], cwd: Path, dsn: str) -> subprocess.Popen[bytes]:
    with (cwd / "log").open("ab") as log:
        return subprocess.Popen(
            command, cwd=cwd, env={**os.environ, "AIOQ_DSN": dsn}, stdout=log, stderr=log
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_judge_health_decides_without_io() -> None:
    now = 1000.0
    fresh = judge_health(
        started=True, stopping=False, listening=True, answered_at=now - 1, started_at=now - 100,
        loop_lag=0.0, now=now,
    )  # fmt: skip
    assert (fresh.live, fresh.ready, fresh.detail) == (True, True, "ok")
    stale = judge_health(
        started=True, stopping=False, listening=True, answered_at=now - STALE_AFTER - 1,
        started_at=now - 1000, loop_lag=0.0, now=now,
    )  # fmt: skip
    assert (stale.live, stale.ready) == (False, False)
    assert "database has not answered for 61s" in stale.detail
    # A young run is not failed for a ping it has not made yet, but is not ready either.
    young = judge_health(
        started=True, stopping=False, listening=True, answered_at=None, started_at=now - 1,
        loop_lag=0.0, now=now,
    )  # fmt: skip
    assert (young.live, young.ready) == (True, False)
    # Stopping (the shutdown grace): live, so that nothing kills the jobs it finishes.
    stopping = judge_health(
        started=True, stopping=True, listening=True, answered_at=now, started_at=now - 9,
        loop_lag=0.0, now=now,
    )  # fmt: skip
    assert (stopping.live, stopping.ready, stopping.detail) == (True, False, "stopping")
    # Stopping closes the LISTEN connection: that is the shutdown, not a second fault.
    closed = judge_health(
        started=True, stopping=True, listening=False, answered_at=now, started_at=now - 9,
        loop_lag=0.0, now=now,
    )  # fmt: skip
    assert (closed.live, closed.ready, closed.detail) == (True, False, "stopping")
    no_listen = judge_health(
        started=True, stopping=False, listening=False, answered_at=now, started_at=now - 9,
        loop_lag=0.0, now=now,
    )  # fmt: skip
    assert (no_listen.live, no_listen.ready) == (True, False)
    assert no_listen.detail == "the LISTEN connection is down"
    polling = judge_health(
        started=True, stopping=False, listening=None, answered_at=now, started_at=now - 9,
        loop_lag=0.0, now=now,
    )  # fmt: skip
    assert polling.ready
    blocked = judge_health(
        started=True, stopping=False, listening=True, answered_at=now, started_at=now - 99,
        loop_lag=45.0, now=now,
    )  # fmt: skip
    assert (blocked.live, blocked.detail) == (False, "the event loop was blocked for 45s")


def test_the_default_grace_fits_kubernetes_default_termination_grace() -> None:
    """30 s: the grace, then the final write (MIN_FINAL_WRITE at most beyond the grace when
    the jobs end late) must leave room for the release inside it."""
    assert DEFAULT_SHUTDOWN_GRACE + MIN_FINAL_WRITE < 30.0


@pytest.mark.anyio
async def test_probe_notes_when_the_database_answered(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        # The ping's own timeout is the interval: a realistic one (10 ms timed out under load).
        probe = Probe(schema="aioq", db=pool, interval=5.0)
        assert probe.answered_at is None
        before = time.monotonic()
        await probe.run_once()
        assert probe.answered_at is not None
        assert probe.answered_at >= before
        await probe.wait(0.01)
        await probe.run_once()
        assert probe.woke_late >= 0.0
    finally:
        await pool.close()


@pytest.mark.anyio
async def test_an_embedded_worker_reports_its_health_and_serves_it(
    make_worker: MakeWorker,
) -> None:
    worker = make_worker()
    before = worker.health()
    assert (before.live, before.ready, before.detail) == (True, False, "starting")
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_health, worker.health, "127.0.0.1", 0)
        status, body = await get(port, "/readyz")
        assert (status, body["ready"], body["detail"]) == (503, False, "starting")
        status, body = await get(port, "/livez")
        assert (status, body["live"], body["ready"]) == (200, True, False)
        async with worker:
            await eventually(lambda: worker.health().ready, "the worker to be ready")
            status, body = await get(port, "/readyz")
            assert (status, body["ready"], body["listening"], body["detail"]) == (
                200,
                True,
                True,
                "ok",
            )
            assert (await get(port, "/livez"))[0] == 200
            assert (await get(port, "/readyz", "HEAD")) == (200, {})
            assert (await get(port, "/metrics"))[0] == 404
            assert (await get(port, "/readyz", "POST"))[0] == 405
            worker.stop()
            status, body = await get(port, "/readyz")
            assert (status, body["detail"]) == (503, "stopping")
            assert (await get(port, "/livez"))[0] == 200  # live while it stops
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_readiness_follows_the_listen_connection(
    conn: asyncpg.Connection, make_worker: MakeWorker
) -> None:
    async with make_worker() as worker:
        await eventually(lambda: worker.health().ready, "the worker to be ready")
        listener = worker.current.listener  # type: ignore[union-attr]
        assert listener is not None
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE 'aioq listener %'"
        )
        await eventually(lambda: not worker.health().ready, "the lost LISTEN to show")
        assert worker.health().detail == "the LISTEN connection is down"
        assert worker.health().live
        await eventually(lambda: worker.health().ready, "the LISTEN to be back")


APP = textwrap.dedent(
    """
    import aioq

    registry = aioq.Registry()


    @registry.task(name="nap")
    async def nap() -> None: ...
    """
)


@pytest.mark.anyio
async def test_aioq_worker_serves_probes_on_one_port_per_process(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "probed.py").write_text(APP)
    port = free_port()
    command = [sys.executable, "-m", "aioq", "worker", "probed:registry", "--processes", "2"]
    command += ["--health-port", str(port)]
    proc = start(command, tmp_path, dsn)
    try:
        for p in (port, port + 1):

            async def ready(p: int = p) -> bool:
                try:
                    return (await get(p, "/readyz"))[0] == 200
                except OSError:
                    return False

            await eventually(ready, f"port {p} to be ready")
            assert (await get(p, "/livez"))[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        kill_tree(proc)  # type: ignore[arg-type]


def test_aioq_worker_refuses_a_port_it_cannot_bind(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "probed.py").write_text(APP)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = aioq_cli(
            dsn, "worker", "probed:registry", "--health-port", str(port), cwd=tmp_path
        )
    assert_one_line_error(result, f"--health-port: cannot serve on 127.0.0.1:{port}")
    for bad in ("0", "70000", "http"):
        result = aioq_cli(dsn, "worker", "probed:registry", "--health-port", bad, cwd=tmp_path)
        assert result.returncode == 2
        assert "--health-port" in result.stderr


def healthy() -> Health:
    return judge_health(
        started=True, stopping=False, listening=None, answered_at=1.0, started_at=0.0,
        loop_lag=0.0, now=1.0,
    )  # fmt: skip


async def closed_by_the_server(stream: anyio.abc.SocketStream) -> None:
    """Return once the server closed this connection (EOF or a reset), having sent nothing."""
    try:
        data = await stream.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
        return
    raise AssertionError(f"the server answered a request never sent: {data!r}")


@pytest.mark.anyio
async def test_connections_past_the_cap_are_closed_at_once_and_probes_answer_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Idle connections hold at most MAX_CONNECTIONS of the server's descriptors: the excess
    are closed as they arrive, and /livez answers once the idle ones are gone."""
    # Idle connections are held until their request times out: long here, so that only the
    # cap can explain the ones closed before it.
    monkeypatch.setattr(health_module, "REQUEST_TIMEOUT", 3600.0)
    flood = 3 * MAX_CONNECTIONS
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_health, healthy, "127.0.0.1", 0)
        streams = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(flood)]
        try:
            closed = 0

            async def watch(stream: anyio.abc.SocketStream) -> None:
                nonlocal closed
                await closed_by_the_server(stream)
                closed += 1

            async with anyio.create_task_group() as watchers:
                for stream in streams:
                    watchers.start_soon(watch, stream)
                await eventually(lambda: closed >= flood - MAX_CONNECTIONS, "the excess closed")
                watchers.cancel_scope.cancel()
            assert closed == flood - MAX_CONNECTIONS  # the first ones are still held
        finally:
            for stream in streams:
                await stream.aclose()

        async def answers() -> bool:
            try:
                return (await get(port, "/livez"))[0] == 200
            except (OSError, anyio.EndOfStream, anyio.BrokenResourceError, IndexError):
                return False  # closed for the cap while the held ones are being let go

        await eventually(answers, "/livez to answer once the flood ended")
        tg.cancel_scope.cancel()


# The server with every descriptor of its process taken, then given back: a subprocess, since
# it lowers its own RLIMIT_NOFILE.
NO_DESCRIPTORS_LEFT = """
import asyncio, logging, os, resource, socket, sys
import anyio
from aioq.worker.health import judge_health, serve_health

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
seen = []
logging.getLogger("aioq.worker.health").addHandler(
    type("H", (logging.Handler,), {"emit": lambda self, record: seen.append(record.getMessage())})()
)


def health():
    return judge_health(started=True, stopping=False, listening=None, answered_at=1.0,
                        started_at=0.0, loop_lag=0.0, now=1.0)


async def main():
    loop = asyncio.get_running_loop()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_health, health, "127.0.0.1", 0)
        client = socket.socket()
        client.setblocking(False)
        hogs = []
        while True:  # take every descriptor left
            try:
                hogs.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        await loop.sock_connect(client, ("127.0.0.1", port))  # the kernel completes it
        with anyio.fail_after(60):
            while not any("cannot accept" in m for m in seen):
                await anyio.sleep(0.01)
        for fd in hogs:
            os.close(fd)
        await loop.sock_sendall(client, b"GET /livez HTTP/1.0\\r\\n\\r\\n")
        answer = b""
        with anyio.fail_after(60):
            while chunk := await loop.sock_recv(client, 4096):
                answer += chunk
        print("ANSWER", answer.split(b"\\r\\n", 1)[0].decode(), flush=True)
        tg.cancel_scope.cancel()


anyio.run(main)
"""


def test_a_failed_accept_is_logged_and_the_server_goes_on() -> None:
    """No descriptor left for an accept (EMFILE): the server says so and accepts again once
    descriptors are back, never raising into the run that started it."""
    ran = subprocess.run(
        [sys.executable, "-c", NO_DESCRIPTORS_LEFT], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "health server: cannot accept a connection (OSError: [Errno 24]" in ran.stdout
    assert "health server: accepting again" in ran.stdout
    assert "ANSWER HTTP/1.0 200 OK" in ran.stdout


# An `aioq worker` with few descriptors: RLIMIT_NOFILE set, then the console script run.
LIMITED = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64));"
LIMITED += " os.execv(sys.argv[1], sys.argv[1:])"


@pytest.mark.anyio
async def test_a_flood_of_idle_probe_connections_never_stops_the_worker(
    dsn: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    """200 idle connections to --health-port of a worker allowed 64 descriptors: it goes on
    running jobs, and /livez answers once the flood ends (it died of EMFILE: exit 2)."""
    (tmp_path / "probed.py").write_text(APP)
    port = free_port()
    command = [sys.executable, "-c", LIMITED, AIOQ, "worker", "probed:registry"]
    command += ["--health-port", str(port), "--poll-interval", "0.2"]
    proc = start(command, tmp_path, dsn)
    log = lambda: (tmp_path / "log").read_text()  # noqa: E731

    async def ready() -> bool:
        try:
            return (await get(port, "/readyz"))[0] == 200
        except OSError:
            return False

    try:
        await eventually(ready, "the worker to be ready")
        flood = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(200)]
        try:
            for n in range(3):  # jobs run while the flood holds its connections
                job_id = await conn.fetchval(
                    "INSERT INTO aioq.jobs (queue, task) VALUES ('default', 'nap') RETURNING id"
                )
                await eventually(
                    lambda job_id=job_id: done(conn, job_id), f"job {n} to run during the flood"
                )
                assert proc.poll() is None, log()
        finally:
            for stream in flood:
                await stream.aclose()
        await eventually(ready, "/readyz to answer once the flood ended")
        assert (await get(port, "/livez"))[0] == 200
        assert proc.poll() is None, log()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log()
    finally:
        kill_tree(proc)  # type: ignore[arg-type]


async def done(conn: asyncpg.Connection, job_id: int) -> bool:
    return await conn.fetchval("SELECT NOT EXISTS (SELECT FROM aioq.jobs WHERE id = $1)", job_id)
