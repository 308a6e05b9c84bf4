"""The dashboard's ASGI app: :func:`app` builds it; mount it anywhere or run ``aioq web``.

Safety: read-only unless built with ``actions=True``; actions are POSTs carrying a CSRF token
(a random value in a SameSite=Strict cookie that the form repeats, compared in constant time);
``authorize(request)`` is asked before every request; every statement runs in a transaction
whose ``statement_timeout`` bounds it, and reads in a read-only one.
"""

from __future__ import annotations

import hmac
import inspect
import json
import logging
import math
import re
import secrets
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlencode

import anyio
import asyncpg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from aioq import admin
from aioq.db import Connection
from aioq.errors import ConfigError
from aioq.sql import DEFAULT_SCHEMA, quote_schema
from aioq.sql.history import ROLLUP_STEP
from aioq.store import Store
from aioq.web import data
from aioq.web.filters import environment

__all__ = ("DashboardConfig", "app")

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
CSRF_COOKIE = "aioq_csrf"
CSRF_FIELD = "csrf"
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
DONE_MESSAGE = re.compile(r"(retried|cancelled|deleted) \d+ of \d+ jobs?( \(\d+ stopping\))?")


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
    stale_after: float = 180.0  # a worker unseen this long is shown as gone
    title: str = "aioq"

    def __post_init__(self) -> None:
        quote_schema(self.schema)
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


class _Database:
    """The dashboard's pool (its own, from a DSN, made on first use; or the caller's)."""

    def __init__(
        self, dsn: str | None, pool: asyncpg.Pool | None, store: Store, timeout: float
    ) -> None:
        self.dsn, self._pool, self.store, self.timeout = dsn, pool, store, timeout
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
                await self.store.set_statement_timeout(conn, self.timeout)
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

    ``actions=True`` allows retry, cancel and delete; ``authorize(request)`` (sync or async)
    is asked before every request and a false answer is a 403. ``options`` are the fields of
    :class:`DashboardConfig`. Mount it: ``app.mount("/aioq", aioq.web.app(dsn=DSN))``.
    """
    if (dsn is None) == (pool is None):
        raise ConfigError("dsn", "give the dashboard either dsn= or pool=, not both nor neither")
    config = DashboardConfig(schema=schema, actions=actions, **options)
    database = _Database(dsn, pool, Store.for_schema(schema), config.statement_timeout)
    pages = _Pages(config, database, authorize)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await database.close()

    web = Starlette(
        routes=[
            Route("/", pages.overview, name="overview"),
            Route("/live", pages.live, name="live"),
            Route("/jobs", pages.jobs, name="jobs"),
            Route("/jobs/{job_id:int}", pages.job, name="job"),
            Route("/actions", pages.actions, methods=["POST"], name="actions"),
            Route("/throughput", pages.throughput, name="throughput"),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        lifespan=lifespan,
    )
    web.state.aioq_database = database  # `await app.state.aioq_database.close()` when mounted
    return web


class _Pages:
    """The request handlers; each asks ``authorize`` first."""

    def __init__(self, config: DashboardConfig, db: _Database, authorize: Authorize | None):
        self.config, self.db, self.authorize = config, db, authorize
        self.store = Store.for_schema(config.schema)
        self.env = environment(HERE / "templates")

    async def _allowed(self, request: Request) -> bool:
        if self.authorize is None:
            return True
        answer = self.authorize(request)
        if inspect.isawaitable(answer):
            answer = await answer
        return bool(answer)

    def _render(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        token = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)
        context.setdefault("page", "")
        template = self.env.get_template(name)
        html = template.render(
            request=request,
            config=self.config,
            csrf=token,
            statuses=data.LISTED_STATUSES,
            url=lambda route, **params: request.url_for(route, **params).path,
            message=_message(request.query_params.get("done")),
            **context,
        )
        response = HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
        if CSRF_COOKIE not in request.cookies:
            response.set_cookie(
                CSRF_COOKIE,
                token,
                httponly=True,
                samesite="strict",
                path=request.scope.get("root_path") or "/",
            )
        return response

    async def _guarded(self, request: Request, page: Callable[[], Awaitable[Response]]) -> Response:
        if not await self._allowed(request):
            return PlainTextResponse("forbidden", status_code=403)
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
                conn, self.store, cap=self.config.count_cap, stale_after=self.config.stale_after
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
                    self.store,
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
                every_dead=_retry_command(filters, self.config.schema),
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

    async def throughput(self, request: Request) -> Response:
        """Outcomes per minute, and wait and run percentiles, from the per-minute history."""

        async def page() -> Response:
            name = request.query_params.get("range", "hour")
            queue = request.query_params.get("queue", "").replace("\x00", "") or None
            seconds, step = RANGES.get(name, RANGES["hour"])
            async with self.db.transaction(readonly=True) as conn:
                history = await data.load_history(
                    conn, self.store, seconds=seconds, step=step, queue=queue
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
        """Retry, cancel or delete the jobs whose ids the form posts."""
        if not await self._allowed(request):
            return PlainTextResponse("forbidden", status_code=403)
        if not self.config.actions:
            return PlainTextResponse("this dashboard is read-only", status_code=403)
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        sent = (form.get(CSRF_FIELD) or [""])[0]
        cookie = request.cookies.get(CSRF_COOKIE, "")
        if not cookie or not hmac.compare_digest(sent.encode(), cookie.encode()):
            return PlainTextResponse("missing or wrong CSRF token", status_code=403)
        action = (form.get("action") or [""])[0]
        ids = [i for i in map(_int, form.get("ids", [])) if i is not None][:MAX_SELECTION]
        if action not in ("retry", "cancel", "delete"):
            return PlainTextResponse(f"unknown action {action!r}", status_code=400)
        return await self._guarded(request, lambda: self._act(request, action, ids, form))

    async def _act(
        self, request: Request, action: str, ids: list[int], form: dict[str, list[str]]
    ) -> Response:
        schema = self.config.schema
        stopping = 0  # running jobs asked to cancel: their workers stop them
        async with self.db.transaction(readonly=False) as conn:
            if not ids:
                count = 0
            elif action == "retry":
                replay = await admin.retry_dead(conn, job_id=ids, schema=schema)
                count = len(replay.retried)  # a dead job whose unique_key is live stays dead
            elif action == "cancel":
                states = list((await admin.cancel_jobs(conn, ids, schema=schema)).values())
                stopping = states.count("cancelling")
                count = states.count("cancelled") + stopping
            else:
                count = len(await admin.delete_jobs(conn, ids, schema=schema))
        logger.info("aioq web: %s %d of %d jobs", action, count, len(ids))
        verb = {"retry": "retried", "cancel": "cancelled", "delete": "deleted"}[action]
        message = f"{verb} {count} of {len(ids)} job{'s' if len(ids) != 1 else ''}"
        if stopping:
            message += f" ({stopping} stopping)"
        target = _safe_next((form.get("next") or [""])[0], request)
        joiner = "&" if "?" in target else "?"
        return RedirectResponse(f"{target}{joiner}{urlencode({'done': message})}", 303)


def _message(value: str | None) -> str | None:
    return value if value is not None and DONE_MESSAGE.fullmatch(value) else None


MAX_ID = 2**63 - 1  # bigint: a larger id cannot exist, and the driver would refuse it


def _int(value: str | None) -> int | None:
    """A job id from a query string or form, or None for anything that cannot be one."""
    if not value or not value.isascii() or not value.isdigit():
        return None
    number = int(value)
    return number if number <= MAX_ID else None


def _here(request: Request) -> str:
    """The path and query of this page, to come back to after an action."""
    query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "done"])
    return request.url.path + (f"?{query}" if query else "")


def _retry_command(filters: dict[str, str], schema: str) -> str | None:
    """The ``aioq jobs retry`` line that retries every dead job of a filter, beyond this page.

    None unless the filter is one the command can express (dead jobs by queue and task, not by
    error text): the page's buttons act on ticked rows only.
    """
    if filters["status"] != "dead" or filters["q"]:
        return None
    narrowed = [f"--{k} {shlex.quote(filters[k])}" for k in ("queue", "task") if filters[k]]
    if schema != DEFAULT_SCHEMA:
        narrowed.append(f"--schema {shlex.quote(schema)}")
    return " ".join(["aioq jobs retry --dead", *narrowed])


def _safe_next(target: str, request: Request) -> str:
    """Come back to a page of this dashboard only (never an open redirect)."""
    base = request.url_for("overview").path
    if target.startswith(base) and not target.startswith("//") and "\\" not in target:
        return target  # "//host" and "/\\host" are other sites to a browser
    return base
