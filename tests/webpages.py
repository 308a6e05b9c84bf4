"""Helpers of the dashboard's tests: rows to show, and what a page says or links to."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from html import unescape
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import asyncpg
from starlette.applications import Starlette
from starlette.routing import BaseRoute

import aioq.web

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
STATIC = Path(aioq.web.__file__).parent / "static"
# Every URL a page makes the browser load or send to: links, the script, the stylesheet, forms,
# and the overview's refresh.
_URLS = re.compile(r'\b(href|src|action|data-src)="([^"]*)"')


def sql(dsn: str, statement: str, *args: Any) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetch(statement, *args)
        finally:
            await conn.close()

    return asyncio.run(run())


def add_jobs(dsn: str, queue: str, count: int, **columns: Any) -> list[int]:
    """Insert ``count`` jobs of task t.<queue> with extra column values; return their ids."""
    names = ", ".join(columns)
    values = ", ".join(f"${i + 3}" for i in range(len(columns)))
    rows = sql(
        dsn,
        f"INSERT INTO aioq.jobs (queue, task{', ' + names if names else ''})"
        f" SELECT $1, 't.' || $1{', ' + values if values else ''} FROM generate_series(1, $2)"
        " RETURNING id",
        queue,
        count,
        *columns.values(),
    )
    return [r["id"] for r in rows]


def make_dead(dsn: str, ids: list[int], error: str) -> None:
    sql(
        dsn,
        "UPDATE aioq.jobs SET status = 'dead', attempts = max_attempts, last_error = $2"
        " WHERE id = ANY($1)",
        ids,
        error,
    )


def status_of(dsn: str, job_id: int) -> str | None:
    rows = sql(dsn, "SELECT status FROM aioq.jobs WHERE id = $1", job_id)
    return rows[0]["status"] if rows else None


def queue_cells(html: str, queue: str) -> dict[str, str]:
    """The overview's cells of one queue, as text."""
    row = re.search(rf'<tr data-queue="{queue}">(.*?)</tr>', html, re.S)
    assert row, f"queue {queue} not on the overview"
    cells = re.findall(r'data-col="(\w+)">(.*?)</td>', row[1], re.S)
    return {col: re.sub(r"<[^>]+>", "", text).strip() for col, text in cells}


def job_ids(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<td class="num mono"><a href="[^"]*">(\d+)</a>', html)]


def host_app(routes: list[BaseRoute], *dashboards: Starlette) -> Starlette:
    """A host app with ``routes``, whose lifespan enters the dashboards' (their pools close)."""

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for dashboard in dashboards:
                await stack.enter_async_context(dashboard.router.lifespan_context(dashboard))
            yield

    return Starlette(routes=routes, lifespan=lifespan)


def urls(html: str) -> list[tuple[str, str]]:
    """(attribute, URL) of every link, script, stylesheet, form and refresh source of a page."""
    return [(attribute, unescape(url)) for attribute, url in _URLS.findall(html)]


class Response(Protocol):
    status_code: int
    text: str
    content: bytes
    headers: Any


class Client(Protocol):
    """Starlette's TestClient, or an HTTP client of a real server (both httpx clients)."""

    def get(self, url: str, **kwargs: Any) -> Any: ...

    def post(self, url: str, **kwargs: Any) -> Any: ...


def assert_served_under(client: Client, entry: str, base: str, dsn: str) -> None:
    """Browse the dashboard from ``entry`` as a browser would, and check it stays under ``base``.

    Every link, the script and the stylesheet, the forms and the redirects of every page point
    under ``base`` and answer; the static files are the dashboard's own. On a dashboard with
    actions, Replay through the form of a dead job's page replays it.
    """
    (dead,) = add_jobs(dsn, "mount", 1)
    make_dead(dsn, [dead], "boom")
    pages = [
        f"{entry}/",
        f"{entry}/jobs?status=dead",
        f"{entry}/jobs/{dead}",
        f"{entry}/throughput",
    ]
    seen: set[str] = set()
    forms: list[str] = []
    for page in pages:
        response = client.get(page)
        assert response.status_code == 200, (page, response.status_code, response.text[:300])
        for attribute, url in urls(response.text):
            parts = urlsplit(url)
            assert not parts.netloc, (page, url)  # a path on this site, never another host
            assert parts.path.startswith(f"{base}/"), (page, attribute, url, base)
            if attribute == "action":
                forms.append(url)
            elif url not in seen:
                seen.add(url)
                target = client.get(url)
                assert target.status_code == 200, (page, url, target.status_code)
                if "/static/" in parts.path:
                    name = parts.path.rsplit("/", 1)[1]
                    assert target.content == (STATIC / name).read_bytes(), url
    assert {f"{base}/static/style.css", f"{base}/static/app.js"} <= seen
    job_page = client.get(f"{entry}/jobs/{dead}").text
    if "actions enabled" not in job_page:
        assert not CSRF.search(job_page)
        return
    token = CSRF.search(job_page)
    assert token
    action = re.search(r'<form method="post" action="([^"]+)"', job_page)
    assert action, job_page
    assert action[1] == f"{base}/actions"
    back = re.search(r'name="next" value="([^"]+)"', job_page)
    assert back, job_page
    assert unescape(back[1]) == f"{base}/jobs/{dead}"
    done = client.post(
        action[1],
        data={"csrf": token[1], "action": "replay", "ids": str(dead), "next": unescape(back[1])},
        follow_redirects=False,
    )
    assert done.status_code == 303, (done.status_code, done.text)
    location = urlsplit(done.headers["location"])
    assert location.path == f"{base}/jobs/{dead}", done.headers["location"]
    assert status_of(dsn, dead) == "pending"
    shown = client.get(done.headers["location"])
    assert "replayed 1 of 1 job" in shown.text
