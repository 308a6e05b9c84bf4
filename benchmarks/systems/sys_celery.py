"""Celery with a Redis broker: ``Task.delay``, a ``celery worker`` process, a chord.

Celery's client API is synchronous and its worker is a process of its own (the prefork pool
forks ``--concurrency`` children), so this adapter differs from the in-process ones:

- The worker is ``python -m celery -A systems.sys_celery worker`` started by ``worker()``; it
  first consumes an empty queue, and once it is ready (its ``worker_ready`` signal) it is told
  to consume the jobs' queue (``control.add_consumer``): the clock starts there
  (``consuming_since``), not at its process start and the forks.
- Tasks report their start and end to the measuring process with a datagram on a Unix socket
  (``AIOQ_BENCH_REPORT``), stamped with ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock
  for every process of the host); the adapter calls the harness's hooks with that stamp.
- Enqueue calls block; the bulk of a preload and the chord run in a thread, so the event loop
  keeps reading the reports.

Celery runs in a venv of its own (benchmarks/.venv-celery, envs.py): celery[redis] needs
redis-py >= 6.4, arq needs < 6.

Configured as its documentation recommends for short tasks: the prefork pool (the default)
with ``--concurrency c`` (c child processes: a per-worker cap, as aioq's ``concurrency``) and
the default prefetch multiplier (4: each worker reserves up to 4 x c messages). Everything else
is Celery's defaults, among them early acknowledgement (a message is acknowledged just before
its task runs: a worker that dies loses the tasks it had started, where the PostgreSQL queues
here run them again) and no result backend for the no-op task. The chord's steps keep their
results in Redis (a chord needs them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import systems
from systems import System

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUEUE = "celery"  # Celery's default queue
IDLE_QUEUE = "bench-idle"  # what the worker consumes until it is told to start
PREFETCH_MULTIPLIER = 4  # Celery's default, stated for the report

try:
    from celery import Celery, chord
    from celery.signals import worker_ready
except ImportError:  # run.py's interpreter: the description only
    Celery = None  # type: ignore[assignment,misc]

_sock: socket.socket | None = None
_sock_pid = 0


def report(kind: str, i: int) -> None:
    """In the worker's pool process: tell the measuring process that job ``i`` started/ended."""
    global _sock, _sock_pid
    path = os.environ.get("AIOQ_BENCH_REPORT")
    if not path:
        return
    if _sock is None or _sock_pid != os.getpid():  # one socket per forked child
        _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sock_pid = os.getpid()
    _sock.sendto(f"{kind} {i} {time.perf_counter()!r}".encode(), path)


if Celery is not None:
    app = Celery("bench")
    url = os.environ.get("AIOQ_BENCH_CELERY_URL")
    if url:  # the worker process: its broker and backend come from the adapter
        app.conf.broker_url = url
        app.conf.result_backend = url
    app.conf.worker_prefetch_multiplier = PREFETCH_MULTIPLIER
    app.conf.worker_hijack_root_logger = False

    @app.task(name="noop", ignore_result=True)
    def noop(i: int) -> None:
        """The no-op job."""
        report("s", i)
        seconds = float(os.environ.get("AIOQ_BENCH_WORK_SECONDS") or 0)
        if seconds:
            time.sleep(seconds)
        report("e", i)

    @app.task(name="step")
    def step(i: int) -> int:
        """One step of the fan-out: its result goes to the fan-in."""
        report("s", i)
        return i

    @app.task(name="fan_in", ignore_result=True)
    def fan_in(results: list[int]) -> None:
        """The chord's body: runs once every step has run."""
        report("s", systems.FAN_IN)

    @worker_ready.connect
    def _ready(**kwargs: Any) -> None:
        report("r", 0)


class Adapter(System):
    name = "celery"
    backend = "redis"
    single_api = "noop.delay(i)"
    bulk_api = ""  # none: defer_many is not measured; preloads publish in a loop (one producer)
    workflow_api = "chord([step.s(i) for i in range(n)])(fan_in.s())"
    concurrency_api = "celery worker --pool prefork --concurrency c"
    mapping = (
        f"a worker process (prefork pool, c children), prefetch multiplier {PREFETCH_MULTIPLIER} "
        "(its default: up to 4 x c reserved), early acknowledgement (its default), no result "
        "backend for the no-op task, Redis result backend for the chord"
    )

    async def open(self, dsn: str) -> None:
        self.dsn = dsn
        app.conf.broker_url = dsn
        app.conf.result_backend = dsn
        self.sent = 0
        self.ended = 0
        self.ready = asyncio.Event()
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = tempfile.TemporaryDirectory(prefix="aioq-bench-celery-")
        self.path = os.path.join(self.dir.name, "report")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._read)

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(128)
            except BlockingIOError:
                return
            kind, i, stamp = data.decode().split()
            if kind == "r":
                self.ready.set()
                continue
            systems.stamp = float(stamp)
            try:
                if kind == "s":
                    systems.hook(int(i))
                else:
                    self.ended += 1
                    systems.done_hook(int(i))
            finally:
                systems.stamp = None

    async def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()
        self.dir.cleanup()
        app.close()

    async def defer_one(self, i: int) -> None:
        noop.delay(i)  # blocks: Celery's client is synchronous
        self.sent += 1

    def _publish(self, start: int, count: int) -> None:
        with app.producer_or_acquire() as producer:
            for i in range(start, start + count):
                noop.apply_async((i,), producer=producer)

    async def defer_many(self, start: int, count: int) -> None:
        await asyncio.to_thread(self._publish, start, count)
        self.sent += count

    async def remaining(self) -> int:
        return self.sent - self.ended  # ended: reported by the tasks themselves

    def worker_pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    async def run_workflow(self, n: int) -> None:
        """Submit the chord: ``n`` steps, then the fan-in (the harness waits for its start)."""

        def submit() -> None:
            chord(step.s(i) for i in range(n))(fan_in.s())

        await asyncio.to_thread(submit)

    @contextlib.asynccontextmanager
    async def worker(
        self, concurrency: int, *, poll_interval: float = 1.0, listen: bool = True
    ) -> AsyncIterator[None]:
        env = {
            **os.environ,
            "PYTHONPATH": HERE,
            "AIOQ_BENCH_REPORT": self.path,
            "AIOQ_BENCH_CELERY_URL": self.dsn,
            "AIOQ_BENCH_WORK_SECONDS": str(systems.work_seconds),
        }
        hostname = f"bench-{os.getpid()}@localhost"
        cmd = [
            sys.executable,
            *["-m", "celery", "-A", "systems.sys_celery", "worker"],
            *["--pool", "prefork", "--concurrency", str(concurrency)],
            *["--prefetch-multiplier", str(PREFETCH_MULTIPLIER)],
            *["-Q", IDLE_QUEUE, "-n", hostname, "--loglevel", "WARNING"],
        ]
        log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                await asyncio.wait_for(self.ready.wait(), 60)
            except TimeoutError:
                log.seek(0)
                tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"the Celery worker was not ready in 60 s: {tail}") from None
            self.consuming_since = time.perf_counter()
            self.cpu_at_start = self.worker_cpu()
            await asyncio.to_thread(
                app.control.add_consumer, QUEUE, destination=[hostname], reply=True, timeout=5
            )
            yield
        finally:
            self.proc.send_signal(signal.SIGTERM)  # warm shutdown: running tasks finish
            try:
                await asyncio.to_thread(self.proc.wait, 15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
            log.close()
