"""Health probes: what a worker says about itself, and a tiny HTTP server that says it.

docs/architecture.md, "Health". :class:`Probe` is a service that asks the database ``SELECT 1``
every few seconds and notes when it answered; :func:`judge_health` (no I/O) turns what the run
knows into :class:`Health`; :func:`serve_health` answers ``GET /livez`` and ``GET /readyz``
with it over plain HTTP/1.0 on anyio's TCP listener, so probes need no web framework.

The server never costs the worker its run: it answers MAX_CONNECTIONS connections at a time and
closes the excess at once, gives each REQUEST_TIMEOUT to send its request, and a failed accept
(no descriptor left: EMFILE) is logged and retried with backoff, never raised.

Live: the process can still do its work, so restarting it would not help: its event loop
runs (the probe's own wake-ups are on time, and the server answers at all) and the database
answered recently. A worker starting up or shutting down is live: a liveness failure during
the shutdown grace would have Kubernetes kill the jobs it is finishing.
Ready: it claims: the run is serving and not stopping, its schema was checked at start, its
LISTEN connection is up (when it listens), and the database answered recently.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import anyio
import anyio.abc
import anyio.streams.stapled
import orjson
from anyio.abc import SocketStream as Stream
from anyio.abc import TaskStatus

from aioq.db import Executor
from aioq.sql.admin import PING
from aioq.worker.service import Service

__all__ = (
    "DEFAULT_HEALTH_ADDR",
    "PROBE_INTERVAL",
    "STALE_AFTER",
    "Health",
    "Probe",
    "judge_health",
    "serve_health",
)

logger = logging.getLogger(__name__)

DEFAULT_HEALTH_ADDR = "127.0.0.1"
# The probe's ping; the database "answered recently" when a ping succeeded within STALE_AFTER,
# long enough to ride out a failover or a restart of the database (a worker restarted for it
# would find the same database), short enough that a wedged pool shows.
PROBE_INTERVAL = 5.0
STALE_AFTER = 60.0
# A probe that wakes this late found its event loop blocked that long (a task blocking it).
BLOCKED_AFTER = 30.0
MAX_REQUEST = 8192  # bytes of request line and headers read at most
# A probe sends its request as it connects (the kubelet's waits 1 s by default for the answer).
REQUEST_TIMEOUT = 2.0
# Connections answered at once: a few probes need a handful; idle or slow clients beyond this
# are closed as they arrive, so they cannot take the worker's file descriptors.
MAX_CONNECTIONS = 16
# A failed accept (EMFILE, ENFILE, ENOBUFS, ...) is retried after this, doubled up to the
# second while it keeps failing.
ACCEPT_RETRY = 0.05
ACCEPT_RETRY_MAX = 1.0
EXCESS_LOG_EVERY = 60.0  # seconds between two warnings of connections closed for the cap


class Probe(Service[None]):
    """Ping the database every ``interval`` seconds; note when it answered and how late the
    probe itself woke (the event loop's lag)."""

    name = "probe"

    def __init__(self, *, schema: str, db: Executor, interval: float = PROBE_INTERVAL) -> None:
        super().__init__()
        self.schema = schema
        self.db = db
        self.period = interval
        self.answered_at: float | None = None  # time.monotonic() of the last good ping
        self.woke_late = 0.0  # seconds the last wake-up came after it was due
        self._due: float | None = None

    async def run_once(self) -> None:
        """Ping once; note the time it answered."""
        now = time.monotonic()
        if self._due is not None:
            self.woke_late = max(0.0, now - self._due)
        await PING.run(self.db, self.schema, within=self.period)
        self.answered_at = time.monotonic()

    def interval(self) -> float:
        """The ping period."""
        return self.period

    async def wait(self, seconds: float) -> None:
        """Sleep, noting when the wake-up is due (what the lag is measured against)."""
        self._due = time.monotonic() + seconds
        await anyio.sleep(seconds)

    def log_failure(self, exc: Exception, delay: float) -> None:
        """At DEBUG: the loops that need the database say it louder."""
        logger.debug("health ping failed: %s: %s", type(exc).__name__, exc)


@dataclass(frozen=True, slots=True)
class Health:
    """A worker's health: ``live`` and ``ready`` and the checks behind them."""

    live: bool
    ready: bool
    serving: bool  # the run started and is not stopping (claims go on)
    listening: bool | None  # the LISTEN connection is up (None: the worker polls only)
    database_age: float | None  # seconds since the database last answered (None: never yet)
    loop_lag: float  # how late the probe last woke, in seconds
    detail: str  # what fails, in words ("ok" when nothing does)

    def as_json(self) -> bytes:
        """The health as a JSON object (the probes' response body)."""
        return orjson.dumps(asdict(self))


def judge_health(
    *,
    started: bool,
    stopping: bool,
    listening: bool | None,
    answered_at: float | None,
    started_at: float | None,
    loop_lag: float,
    now: float,
) -> Health:
    """Decide live and ready from what a worker knows (no I/O).

    ``started_at``: when the run began (monotonic), so that a run younger than STALE_AFTER is
    not failed for a ping it has not had the time to make.
    """
    age = None if answered_at is None else now - answered_at
    since = answered_at if answered_at is not None else started_at
    db_ok = since is None or now - since <= STALE_AFTER
    loop_ok = loop_lag < BLOCKED_AFTER
    serving = started and not stopping
    problems = []
    if not db_ok:
        problems.append(f"the database has not answered for {now - (since or now):.0f}s")
    if not loop_ok:
        problems.append(f"the event loop was blocked for {loop_lag:.0f}s")
    live = db_ok and loop_ok
    if not started:
        problems.append("starting")
    elif stopping:
        problems.append("stopping")
    if listening is False and serving:
        # Stopping closes the LISTEN connection on purpose: not a fault to report.
        problems.append("the LISTEN connection is down")
    ready = live and serving and listening is not False and answered_at is not None
    if ready is False and serving and not problems:
        problems.append("no database answer yet")
    return Health(
        live=live,
        ready=ready,
        serving=serving,
        listening=listening,
        database_age=age,
        loop_lag=loop_lag,
        detail="; ".join(problems) or "ok",
    )


_ROUTES = {"/livez": "live", "/readyz": "ready"}


async def serve_health(
    health: Callable[[], Health],
    host: str,
    port: int,
    *,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /livez`` and ``GET /readyz`` on ``host:port`` until cancelled: 200 when the
    check passes, 503 when it fails, the :class:`Health` as JSON either way. Reports the port
    bound (port 0: any free one) once listening; a port that cannot be bound raises OSError.
    Once serving it raises nothing: whatever fails is logged and the server goes on."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    async with listener:
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        logger.info("serving health probes on http://%s:%d/livez and /readyz", host, bound)
        task_status.started(bound)
        await _Server(health).serve(listener)


class _Server:
    """Accepts and answers connections, at most MAX_CONNECTIONS at a time."""

    def __init__(self, health: Callable[[], Health]) -> None:
        self.health = health
        self.active = 0  # connections being answered
        self.excess = 0  # connections closed for the cap since the last warning
        self.excess_logged = -math.inf  # time.monotonic() of that warning

    async def serve(self, listener: anyio.streams.stapled.MultiListener[Stream]) -> None:
        """Accept on each address of the listener until cancelled."""
        async with anyio.create_task_group() as tg:
            for one in listener.listeners:
                assert isinstance(one, anyio.abc.SocketListener)
                tg.start_soon(self._accept, one, tg)

    async def _accept(self, listener: anyio.abc.SocketListener, tg: anyio.abc.TaskGroup) -> None:
        """Accept on one socket; a failed accept is retried with backoff, never raised."""
        failures, delay = 0, ACCEPT_RETRY
        while True:
            try:
                stream = await listener.accept()
            except Exception as exc:  # EMFILE, ENFILE, ENOBUFS, ECONNABORTED, ...
                if failures == 0:
                    logger.warning(
                        "health server: cannot accept a connection (%s: %s); the worker goes"
                        " on, the server retries",
                        type(exc).__name__,
                        exc,
                    )
                failures += 1
                await anyio.sleep(delay)
                delay = min(delay * 2, ACCEPT_RETRY_MAX)
                continue
            if failures:
                logger.warning("health server: accepting again (%d failed accepts)", failures)
                failures, delay = 0, ACCEPT_RETRY
            if self.active >= MAX_CONNECTIONS:
                await self._refuse(stream)
                continue
            self.active += 1
            tg.start_soon(self._answer, stream)

    async def _refuse(self, stream: Stream) -> None:
        """Close a connection past the cap at once (its descriptor is back before the next)."""
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await stream.aclose()  # a client that went away meanwhile: nothing to do
        self.excess += 1
        now = time.monotonic()
        if now - self.excess_logged >= EXCESS_LOG_EVERY:
            logger.warning(
                "health server: %d connections closed at once: %d were already open (the cap)",
                self.excess,
                MAX_CONNECTIONS,
            )
            self.excess, self.excess_logged = 0, now

    async def _answer(self, stream: Stream) -> None:
        try:
            async with stream:
                with anyio.fail_after(REQUEST_TIMEOUT):
                    request = await _read_head(stream)
                    status, body = _respond(request, self.health)
                    head = (
                        f"HTTP/1.0 {status}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
                        "Connection: close\r\n\r\n"
                    )
                    await stream.send(head.encode("ascii") + body)
        except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            pass  # a client that went away, never finished its request or did not read
        except Exception:  # never the worker's end: a probe that fails is answer enough
            logger.exception("health server: a request failed")
        finally:
            self.active -= 1


async def _read_head(stream: Stream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data and len(data) < MAX_REQUEST:
        data += await stream.receive(MAX_REQUEST)
    return data


def _respond(request: bytes, health: Callable[[], Health]) -> tuple[str, bytes]:
    """The status line's code and reason, and the body, for one request."""
    parts = request.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
    if len(parts) < 2:
        return "400 Bad Request", b'{"error": "bad request"}'
    method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1").split("?", 1)[0]
    check = _ROUTES.get(target)
    if check is None:
        return "404 Not Found", b'{"error": "not found: try /livez or /readyz"}'
    if method not in ("GET", "HEAD"):
        return "405 Method Not Allowed", b'{"error": "GET only"}'
    now = health()
    ok = now.live if check == "live" else now.ready
    body = b"" if method == "HEAD" else now.as_json()
    return ("200 OK" if ok else "503 Service Unavailable"), body
