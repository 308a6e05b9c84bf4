"""The dashboard's ASGI app: :func:`app` builds it; mount it anywhere or run ``aioq web``.

Where it is: every link, form and redirect is one of the dashboard's own routes under the path
it is served at, the ASGI ``root_path`` of its requests (a Starlette ``Mount``'s path, a proxy's
prefix, what a Django project's router sets): never a route of the host app, so it works
mounted at any path, named or not, several times in one app, behind a proxy.

Safety: a dashboard without ``authorize`` answers only the host names that are its own
(:mod:`aioq.web.hosts`: against DNS rebinding) and ``allowed_hosts``; ``authorize(request)`` is
asked before anything answers, static files and unknown paths included; read-only unless built
with ``actions=True``. An action is a POST carrying a CSRF token: the HMAC, under the
dashboard's secret, of its path and of a random value the browser keeps in a cookie (HttpOnly,
SameSite=Strict; over HTTPS named ``__Host-`` and Secure), compared in constant time. A cookie
planted by a neighbouring site is no key without the secret, and a POST the browser says came
from another site is refused whatever it carries. Every statement runs in a transaction whose
``statement_timeout`` bounds it, and reads in a read-only one.
"""

from __future__ import annotations

import base64
import hmac
import inspect
import json
import logging
import math
import re
import secrets
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlencode

import anyio
import asyncpg
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route, Router
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from aioq import admin
from aioq.db import Connection
from aioq.errors import ConfigError
from aioq.sql import DEFAULT_SCHEMA, quote_schema
from aioq.sql.history import ROLLUP_STEP
from aioq.web import data
from aioq.web.filters import environment
from aioq.web.hosts import AllowedHosts
from aioq.web.sql import SET_STATEMENT_TIMEOUT
from aioq.worker.history import DEFAULT_STATS_INTERVAL
from aioq.workflows import workflow as get_workflow

__all__ = ("DashboardConfig", "app")

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
CSRF_COOKIE = "aioq_csrf"  # over plain http, for the dashboard's path
# Over HTTPS: a browser takes a __Host- cookie only from a secure page of this very host, with
# Path=/ and no Domain, so neither a sibling subdomain nor a plain-http page can plant one.
CSRF_COOKIE_HTTPS = "__Host-aioq_csrf"
CSRF_FIELD = "csrf"
SESSION = re.compile(r"[A-Za-z0-9_-]{43}")  # the cookie's value: secrets.token_urlsafe(32)
MIN_SECRET = 16  # bytes
# What a browser says of a POST made by another site's page (Fetch Metadata): refused.
FOREIGN_SITES = ("cross-site", "same-site")
MAX_SELECTION = 1000  # ids one POST may act on
# Seconds shown, step; a day in half hours reads the rollup (aioq.web.data.load_history).
RANGES = {"hour": (3600.0, 60.0), "day": (86400.0, ROLLUP_STEP)}

Authorize = Callable[[Request], bool | Awaitable[bool]]

# Every page: only our own script and stylesheet run, and no other site may frame the page
# (a framed action button could be clicked through an overlay).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none';"
    " form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
}
# What an action's redirect may ask the next page to say; anything else in ?done= is ignored,
# so a link cannot make the dashboard display text of someone else's choosing.
DONE_MESSAGE = re.compile(
    r"(replayed|cancelled|deleted) \d+ of \d+ jobs?"
    r"( \(\d+ stopping\))?( \(\d+ dependent steps? revived: \d+(, \d+){0,4}(, \.\.\.)?\))?"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DashboardConfig:
    """How the dashboard reads and what it allows; durations in seconds."""

    schema: str = DEFAULT_SCHEMA
    actions: bool = False
    refresh: float = 5.0  # auto-refresh of the overview; 0 turns it off
    statement_timeout: float = 3.0
    page_size: int = 50
    window: int = 2000  # rows of the jobs table one page of the job list reads at most
    count_cap: int = 10_000  # counts stop here and show as "10,000+"
    # A worker whose row is older is gone: one and a half of the workers' stats_interval
    # (aioq.web.data.is_alive); set it to 1.5 x theirs if they write less often.
    stale_after: float = 1.5 * DEFAULT_STATS_INTERVAL
    title: str = "aioq"
    # Signs the CSRF tokens. None: a random one per app, which is right for one process; every
    # process serving one dashboard behind one address needs the same (at least 16 bytes).
    secret: str | bytes | None = field(default=None, repr=False)
    # Host names answered beyond the server's own address (aioq.web.hosts): the names a proxy
    # forwards, ".example.com" for a domain and its subdomains, "*" for any. None: with
    # `authorize`, no check (the host app's); without it, the server's own address only.
    allowed_hosts: Sequence[str] | None = None

    def __post_init__(self) -> None:
        quote_schema(self.schema)
        if self.allowed_hosts is not None:
            AllowedHosts.of(self.allowed_hosts)  # a ConfigError names a bad one
            object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        if self.secret is not None and (
            not isinstance(self.secret, str | bytes) or len(_key(self.secret)) < MIN_SECRET
        ):
            raise ConfigError(
                "secret",
                f"must be a str or bytes of at least {MIN_SECRET} bytes (e.g."
                " secrets.token_urlsafe(32))",
            )
        if not self.stale_after > 0:
            raise ConfigError("stale_after", f"must be > 0 seconds, got {self.stale_after!r}")
        if not (self.refresh == 0 or self.refresh >= 1):
            raise ConfigError("refresh", f"must be 0 (off) or >= 1 second, got {self.refresh!r}")
        if not self.statement_timeout > 0:
            raise ConfigError(
                "statement_timeout", f"must be > 0 seconds, got {self.statement_timeout!r}"
            )
        for name in ("page_size", "window", "count_cap"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")


def _key(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


class _Database:
    """The dashboard's pool (its own, from a DSN, made on first use; or the caller's)."""

    def __init__(
        self, dsn: str | None, pool: asyncpg.Pool | None, schema: str, timeout: float
    ) -> None:
        self.dsn, self._pool, self.schema, self.timeout = dsn, pool, schema, timeout
        self._owned = pool is None
        self._lock = anyio.Lock()

    async def pool(self) -> asyncpg.Pool:
        async with self._lock:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    self.dsn,
                    min_size=0,
                    max_size=3,
                    server_settings={"application_name": "aioq web"},
                )
        return self._pool

    @asynccontextmanager
    async def transaction(self, *, readonly: bool) -> AsyncIterator[Connection]:
        pool = await self.pool()
        async with pool.acquire() as conn:
            # Reads see one snapshot, so the page's counts agree with each other.
            isolation: Literal["repeatable_read", "read_committed"] = (
                "repeatable_read" if readonly else "read_committed"
            )
            async with conn.transaction(isolation=isolation, readonly=readonly):
                await SET_STATEMENT_TIMEOUT.run(conn, self.schema, f"{int(self.timeout * 1000)}ms")
                yield conn

    async def close(self) -> None:
        if self._owned and self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()


def app(
    *,
    dsn: str | None = None,
    pool: asyncpg.Pool | None = None,
    schema: str = DEFAULT_SCHEMA,
    actions: bool = False,
    authorize: Authorize | None = None,
    **options: Any,
) -> Starlette:
    """Return the dashboard as an ASGI app on ``dsn`` (its own small pool) or on ``pool``.

    ``actions=True`` allows replay, cancel and delete; ``authorize(request)`` (sync or async)
    is asked before anything answers a request (before routing: no path parameters yet) and
    a false answer is a 403. Without ``authorize``, a request whose ``Host`` is not the
    server's own address (and, on a loopback one, localhost) nor one of ``allowed_hosts`` gets a
    400 (DNS rebinding); behind a proxy, name the host it forwards:
    ``allowed_hosts=["queue.example.com"]``. ``options`` are the fields of
    :class:`DashboardConfig`. Mount it at any path: ``app.mount("/aioq", aioq.web.app(dsn=DSN))``.
    """
    if (dsn is None) == (pool is None):
        raise ConfigError("dsn", "give the dashboard either dsn= or pool=, not both nor neither")
    config = DashboardConfig(schema=schema, actions=actions, **options)
    database = _Database(dsn, pool, schema, config.statement_timeout)
    key = secrets.token_bytes(32) if config.secret is None else _key(config.secret)
    pages = _Pages(config, database, key)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await database.close()

    checked = config.allowed_hosts is not None or authorize is None
    hosts = AllowedHosts.of(config.allowed_hosts or ()) if checked else None
    web = Starlette(
        routes=pages.routes,
        middleware=[Middleware(_Authorized, authorize=authorize, hosts=hosts)],
        lifespan=lifespan,
    )
    web.state.aioq_database = database  # `await app.state.aioq_database.close()` when mounted
    return web


class _Authorized:
    """Checks the request's ``Host``, then asks ``authorize``, before anything of the dashboard
    answers a request (ASGI middleware)."""

    def __init__(self, app: ASGIApp, authorize: Authorize | None, hosts: AllowedHosts | None):
        self.app, self.authorize, self.hosts = app, authorize, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.hosts is not None:
            refused = self.hosts.refusal(scope.get("headers", ()), scope.get("server"))
            if refused is not None:
                logger.info("aioq web: %s", refused.split(" (", 1)[0])
                response = PlainTextResponse(refused, status_code=400, headers=SECURITY_HEADERS)
                await response(scope, receive, send)
                return
        if scope["type"] == "http" and self.authorize is not None:
            answer = self.authorize(Request(scope))
            if inspect.isawaitable(answer):
                answer = await answer
            if not answer:
                await PlainTextResponse("forbidden", status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Pages:
    """The routes and their request handlers."""

    def __init__(self, config: DashboardConfig, db: _Database, key: bytes):
        self.config, self.db, self.key = config, db, key
        self.schema = config.schema
        self.env = environment(HERE / "templates")
        self.routes: list[BaseRoute] = [
            Route("/", self.overview, name="overview"),
            Route("/live", self.live, name="live"),
            Route("/jobs", self.jobs, name="jobs"),
            Route("/jobs/{job_id:int}", self.job, name="job"),
            Route("/workflows", self.workflows, name="workflows"),
            Route("/workflows/{run_id:int}", self.workflow, name="workflow"),
            Route("/actions", self.actions, methods=["POST"], name="actions"),
            Route("/throughput", self.throughput, name="throughput"),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
        self.paths = Router(routes=self.routes)  # URLs of the routes, by name, under their mount

    def _url(self, request: Request, route: str, **params: Any) -> str:
        """The path of one of the dashboard's routes, under the dashboard's own mount."""
        return _base(request) + self.paths.url_path_for(route, **params)

    def _session(self, request: Request) -> tuple[str, str]:
        """The CSRF cookie's name for this request, and its value (empty if none valid)."""
        name = CSRF_COOKIE_HTTPS if request.url.scheme == "https" else CSRF_COOKIE
        value = request.cookies.get(name, "")
        return name, value if SESSION.fullmatch(value) else ""

    def _token(self, request: Request, session: str) -> str:
        """The form's CSRF token: the session cookie and this dashboard's path, signed."""
        message = f"aioq csrf\0{_base(request)}\0{session}".encode()
        return base64.urlsafe_b64encode(hmac.digest(self.key, message, "sha256")).decode()

    def _render(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        cookie, session = self._session(request)
        fresh = self.config.actions and not session  # a read-only dashboard needs no token
        if fresh:
            session = secrets.token_urlsafe(32)
        context.setdefault("page", "")
        template = self.env.get_template(name)
        html = template.render(
            request=request,
            config=self.config,
            csrf=self._token(request, session) if self.config.actions else "",
            statuses=data.LISTED_STATUSES,
            url=lambda route, **params: self._url(request, route, **params),
            message=_message(request.query_params.get("done")),
            **context,
        )
        response = HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
        if fresh:
            secure = cookie == CSRF_COOKIE_HTTPS
            response.set_cookie(
                cookie,
                session,
                httponly=True,
                samesite="strict",
                secure=secure,
                path="/" if secure else _base(request) or "/",
            )
        return response

    async def _guarded(self, request: Request, page: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await page()
        except (asyncpg.PostgresError, OSError, asyncpg.InterfaceError, TimeoutError) as exc:
            logger.warning("aioq web: %s failed: %s: %s", request.url.path, type(exc).__name__, exc)
            return self._render(
                request, "error.html", status=503, error=f"{type(exc).__name__}: {exc}"
            )

    async def overview(self, request: Request) -> Response:
        """The overview page; its live part refreshes itself from /live."""
        return await self._guarded(request, lambda: self._overview(request, "overview.html"))

    async def live(self, request: Request) -> Response:
        """The overview's live part alone, for the auto-refresh."""
        return await self._guarded(request, lambda: self._overview(request, "_live.html"))

    async def _overview(self, request: Request, template: str) -> Response:
        async with self.db.transaction(readonly=True) as conn:
            overview = await data.load_overview(
                conn, self.schema, cap=self.config.count_cap, stale_after=self.config.stale_after
            )
        return self._render(
            request, template, overview=overview, columns=data.STATE_COLUMNS, page="overview"
        )

    async def jobs(self, request: Request) -> Response:
        """A page of jobs, filtered, newest first."""

        async def page() -> Response:
            params = request.query_params
            # PostgreSQL text holds no NUL: a filter with one matches nothing, so drop them.
            filters = {
                k: params.get(k, "").replace("\x00", "").strip()
                for k in ("status", "queue", "task", "q")
            }
            before = _int(params.get("before"))
            async with self.db.transaction(readonly=True) as conn:
                found = await data.load_jobs(
                    conn,
                    self.schema,
                    before=before,
                    status=data.status_filter(filters["status"]),
                    queue=filters["queue"],
                    task=filters["task"],
                    text=filters["q"],
                    limit=self.config.page_size,
                    window=self.config.window,
                )
            kept = {k: v for k, v in filters.items() if v}
            older = urlencode({**kept, "before": found.next_before}) if found.next_before else None
            return self._render(
                request,
                "jobs.html",
                found=found,
                filters=filters,
                before=before,
                older=older,
                newest=urlencode(kept),
                here=_here(request),
                actions_for=data.ACTIONS_BY_STATUS,
                every_dead=_replay_command(filters, self.config.schema),
                page="jobs",
            )

        return await self._guarded(request, page)

    async def job(self, request: Request) -> Response:
        """One job with its arguments and its whole last error."""

        async def page() -> Response:
            job_id = int(request.path_params["job_id"])
            job = None
            if job_id <= MAX_ID:
                async with self.db.transaction(readonly=True) as conn:
                    job = await admin.get_job(conn, job_id, schema=self.config.schema)
            if job is None:
                return self._render(request, "job.html", status=404, job=None, job_id=job_id,
                                    page="jobs")  # fmt: skip
            return self._render(
                request,
                "job.html",
                job=job,
                job_id=job_id,
                args=json.dumps(json.loads(job.args), indent=2, ensure_ascii=False),
                allowed=data.ACTIONS_BY_STATUS.get(job.status.value, ()),
                here=_here(request),
                page="jobs",
            )

        return await self._guarded(request, page)

    async def workflows(self, request: Request) -> Response:
        """Workflow runs, newest first, their steps counted by status."""

        async def page() -> Response:
            name = request.query_params.get("name", "").replace("\x00", "").strip() or None
            async with self.db.transaction(readonly=True) as conn:
                runs = await admin.list_workflows(
                    conn, name=name, limit=self.config.page_size, schema=self.config.schema
                )
            return self._render(
                request, "workflows.html", runs=runs, run_name=name or "", page="workflows"
            )

        return await self._guarded(request, page)

    async def workflow(self, request: Request) -> Response:
        """One run: its steps, their states and dependencies, each linked to its job."""

        async def page() -> Response:
            run_id = int(request.path_params["run_id"])
            info = None
            if run_id <= MAX_ID:
                async with self.db.transaction(readonly=True) as conn:
                    info = await get_workflow(conn, run_id, schema=self.config.schema)
            return self._render(
                request,
                "workflow.html",
                status=200 if info is not None else 404,
                run=info,
                run_id=run_id,
                shown=MAX_STEPS_SHOWN,
                page="workflows",
                here=_here(request),
                live=_step_ids(info, LIVE_STEPS),
                dead=_step_ids(info, ("dead",)),
            )

        return await self._guarded(request, page)

    async def throughput(self, request: Request) -> Response:
        """Outcomes per minute, and wait and run percentiles, from the per-minute history."""

        async def page() -> Response:
            name = request.query_params.get("range", "hour")
            queue = request.query_params.get("queue", "").replace("\x00", "") or None
            seconds, step = RANGES.get(name, RANGES["hour"])
            async with self.db.transaction(readonly=True) as conn:
                history = await data.load_history(
                    conn, self.schema, seconds=seconds, step=step, queue=queue
                )
            end = datetime.now(UTC)
            return self._render(
                request,
                "throughput.html",
                history=history,
                range=name if name in RANGES else "hour",
                ranges=list(RANGES),
                start=end - timedelta(seconds=seconds),
                slots=math.ceil(seconds / step),
                page="throughput",
            )

        return await self._guarded(request, page)

    async def actions(self, request: Request) -> Response:
        """Replay, cancel or delete the jobs whose ids the form posts."""
        if not self.config.actions:
            return PlainTextResponse("this dashboard is read-only", status_code=403)
        if request.headers.get("sec-fetch-site") in FOREIGN_SITES:
            return PlainTextResponse("refused: posted from another site", status_code=403)
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        sent = (form.get(CSRF_FIELD) or [""])[0]
        _, session = self._session(request)
        expected = self._token(request, session)
        if not session or not hmac.compare_digest(sent.encode(), expected.encode()):
            return PlainTextResponse("missing or wrong CSRF token", status_code=403)
        action = (form.get("action") or [""])[0]
        ids = [i for i in map(_int, form.get("ids", [])) if i is not None][:MAX_SELECTION]
        if action == "retry":  # the button's old value: a page loaded before an upgrade
            action = "replay"
        if action not in ("replay", "cancel", "delete"):
            return PlainTextResponse(f"unknown action {action!r}", status_code=400)
        return await self._guarded(request, lambda: self._act(request, action, ids, form))

    async def _act(
        self, request: Request, action: str, ids: list[int], form: dict[str, list[str]]
    ) -> Response:
        schema = self.config.schema
        stopping = 0  # running jobs asked to cancel: their workers stop them
        revived: dict[int, str] = {}  # workflow steps a replay brought back to waiting
        async with self.db.transaction(readonly=False) as conn:
            if not ids:
                count = 0
            elif action == "replay":
                replay = await admin.replay(conn, job_id=ids, schema=schema)
                count = len(replay.replayed)  # a dead job whose unique_key is live stays dead
                revived = replay.revived
            elif action == "cancel":
                run = _int((form.get("run") or [""])[0])
                if run is not None:  # "Cancel run": every live step, each saying why
                    by_id = await admin.cancel_workflow(conn, run, schema=schema)
                    ids = list(by_id)
                else:
                    by_id = await admin.cancel_jobs(conn, ids, schema=schema)
                states = list(by_id.values())
                stopping = states.count("cancelling")
                count = states.count("cancelled") + stopping
            else:
                count = len(await admin.delete_jobs(conn, ids, schema=schema))
        logger.info("aioq web: %s %d of %d jobs", action, count, len(ids))
        verb = {"replay": "replayed", "cancel": "cancelled", "delete": "deleted"}[action]
        message = f"{verb} {count} of {len(ids)} job{'s' if len(ids) != 1 else ''}"
        if stopping:
            message += f" ({stopping} stopping)"
        if revived:
            message += f" ({_revived(revived)})"
        target = _safe_next((form.get("next") or [""])[0], request)
        joiner = "&" if "?" in target else "?"
        return RedirectResponse(f"{target}{joiner}{urlencode({'done': message})}", 303)


REVIVED_NAMED = 5  # job ids a replay's message names; it counts them all


def _revived(revived: dict[int, str]) -> str:
    """What a replay's message says of the workflow steps it revived (DONE_MESSAGE's form:
    ids only, since the message comes back in a URL and must not carry any text)."""
    named = ", ".join(str(job_id) for job_id in list(revived)[:REVIVED_NAMED])
    more = ", ..." if len(revived) > REVIVED_NAMED else ""
    n = len(revived)
    return f"{n} dependent step{'s' if n != 1 else ''} revived: {named}{more}"


def _message(value: str | None) -> str | None:
    return value if value is not None and DONE_MESSAGE.fullmatch(value) else None


MAX_ID = 2**63 - 1  # bigint: a larger id cannot exist, and the driver would refuse it
MAX_STEPS_SHOWN = 2000  # a run's page lists this many steps at most (the CLI shows them all)


LIVE_STEPS = ("waiting", "pending", "running")  # the steps "Cancel run" cancels


def _step_ids(run: admin.WorkflowInfo | None, statuses: tuple[str, ...]) -> list[int]:
    """The job ids of a run's steps in these statuses, as many as one POST may act on."""
    steps = run.steps if run is not None else []
    return [s.job_id for s in steps if s.status in statuses][:MAX_SELECTION]


def _int(value: str | None) -> int | None:
    """A job id from a query string or form, or None for anything that cannot be one."""
    if not value or not value.isascii() or not value.isdigit():
        return None
    number = int(value)
    return number if number <= MAX_ID else None


def _base(request: Request) -> str:
    """The path the dashboard is served at ("" at a host's root), from its requests' root_path.

    A Starlette ``Mount`` adds its path to root_path, a proxy's prefix arrives in it (uvicorn
    ``--root-path``), a Django project's router sets it: the one place the mount is known.
    """
    return str(request.scope.get("root_path", "")).rstrip("/")


def _route_path(request: Request) -> str:
    """The request's path within the dashboard (as Starlette's router reads it): servers put
    root_path in front of the path, and a few leave it out."""
    path, base = request.scope["path"], _base(request)
    if base and (path == base or path.startswith(f"{base}/")):
        return path[len(base) :] or "/"
    return str(path)


def _here(request: Request) -> str:
    """The path and query of this page, to come back to after an action."""
    query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "done"])
    return _base(request) + _route_path(request) + (f"?{query}" if query else "")


def _replay_command(filters: dict[str, str], schema: str) -> str | None:
    """The ``aioq jobs replay`` line that replays every dead job of a filter, beyond this page.

    None unless the filter is one the command can express (dead jobs by queue and task, not by
    error text): the page's buttons act on ticked rows only.
    """
    if filters["status"] != "dead" or filters["q"]:
        return None
    narrowed = [f"--{k} {shlex.quote(filters[k])}" for k in ("queue", "task") if filters[k]]
    if schema != DEFAULT_SCHEMA:
        narrowed.append(f"--schema {shlex.quote(schema)}")
    return " ".join(["aioq jobs replay --dead", *narrowed])


def _safe_next(target: str, request: Request) -> str:
    """Come back to a page of this dashboard only (never an open redirect)."""
    home = f"{_base(request)}/"
    if target.startswith(home) and not target.startswith("//") and "\\" not in target:
        return target  # "//host" and "/\\host" are other sites to a browser
    return home
