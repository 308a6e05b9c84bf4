"""The dashboard in a real browser: Playwright driving the system's Chromium (never downloaded).

`make test` installs Debian's ``chromium`` with apt-get when it can; without a browser (or
without playwright) this module skips and says why. AIOQ_CHROMIUM names another executable.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from starlette.applications import Starlette

import aioq
import aioq.web
from aioq.dev.pgbin import free_port


def _chromium() -> str | None:
    named = os.environ.get("AIOQ_CHROMIUM")
    if named:
        return named
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


CHROMIUM = _chromium()
if CHROMIUM is None:
    pytest.skip(
        "no Chromium on this machine (apt-get install chromium, or set AIOQ_CHROMIUM)",
        allow_module_level=True,
    )
playwright_sync = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
)

T = TypeVar("T")
registry = aioq.Registry()
broken = {"flaky": True}


@registry.task(name="mail.send", queue="mail")
async def send(to: str) -> None:
    pass


@registry.task(name="mail.flaky", queue="mail", max_attempts=1)
async def flaky(n: int) -> None:
    if broken["flaky"]:
        raise ValueError(f"smtp refused message {n}")


def off_thread(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine on a thread of its own (sync Playwright holds this thread's loop)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result(timeout=90)


def drain(dsn: str) -> None:
    """Run a worker until no job is ready (its history written on the way out)."""
    worker = aioq.Worker(
        dsn=dsn,
        registry=registry,
        queues=["mail"],
        poll_interval=0.1,
        stats_interval=0.2,
        keep_completed=True,  # finished jobs stay in the archive, where their page finds them
    )
    off_thread(worker.run_until_idle)


async def _defer(dsn: str) -> list[int]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await send.defer_many(conn, [{"to": f"user{i}@example.com"} for i in range(5)])
        ids = await flaky.defer_many(conn, [{"n": i} for i in range(3)])
        await send.options(queue="later", delay=3600).defer(conn, to="tomorrow@example.com")
        return ids
    finally:
        await conn.close()


async def _sql(dsn: str, statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture
def site(dsn: str, tmp_path: Path) -> Iterator[str]:
    """A real HTTP server: the dashboard read-only at /ro, with actions at /rw (mounted after
    it, with a name), in a host app that serves static files of its own at /static."""
    import uvicorn
    from starlette.staticfiles import StaticFiles

    rw = aioq.web.app(dsn=dsn, actions=True, refresh=1)
    ro = aioq.web.app(dsn=dsn)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # Starlette runs no lifespan of a mounted app: enter theirs, which close their pools.
        async with rw.router.lifespan_context(rw), ro.router.lifespan_context(ro):
            yield

    (tmp_path / "style.css").write_text("/* the host's: none of the dashboard's rules */")
    host = Starlette(lifespan=lifespan)
    host.mount("/static", StaticFiles(directory=tmp_path), name="static")
    host.mount("/ro", ro)
    host.mount("/rw", rw, name="rw")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(host, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive(), "the server stopped"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield browser.new_page(viewport={"width": 1200, "height": 800})
        finally:
            browser.close()


def test_an_operator_finds_a_dead_job_reads_its_error_and_retries_it(
    dsn: str, site: str, page: Any, tmp_path: Path
) -> None:
    expect = playwright_sync.expect
    broken["flaky"] = True
    flaky_ids = off_thread(lambda: _defer(dsn))
    drain(dsn)  # 5 sent, 3 dead, 1 scheduled for later

    # The overview shows the counts, and refreshes them in place; the dashboard's own
    # stylesheet and script are loaded (not the host's at /static, not the other dashboard's).
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{site}/rw/")
    assert page.evaluate("getComputedStyle(document.querySelector('header.top')).display") == "flex"
    assert {f"{site}/rw/static/style.css", f"{site}/rw/static/app.js"} <= set(requested)
    assert not [url for url in requested if url.startswith((f"{site}/static", f"{site}/ro"))]
    mail = page.locator('tr[data-queue="mail"]')
    expect(mail.locator('[data-col="dead"]')).to_have_text("3")
    expect(page.locator('tr[data-queue="later"] [data-col="scheduled"]')).to_have_text("1")
    page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
    page.evaluate("window.stillTheSamePage = true")
    off_thread(lambda: _sql(dsn, "INSERT INTO aioq.jobs (queue, task) VALUES ('later', 'x')"))
    expect(page.locator('tr[data-queue="later"] [data-col="ready"]')).to_have_text("1")
    assert page.evaluate("window.stillTheSamePage") is True  # updated in place, not reloaded

    # Filter the jobs: dead ones of the mail queue, then by text in the error.
    page.get_by_role("link", name="Jobs", exact=True).click()
    page.select_option('select[name="status"]', "dead")
    page.fill('input[name="queue"]', "mail")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#jobs tbody tr")).to_have_count(3)
    page.fill('input[name="q"]', "message 1")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#jobs tbody tr")).to_have_count(1)

    # Open the dead job and read its error, traceback included.
    page.get_by_role("link", name=str(flaky_ids[1]), exact=True).click()
    expect(page.locator("#last-error")).to_contain_text("ValueError: smtp refused message 1")
    expect(page.locator("#last-error")).to_contain_text("Traceback")

    # Replay it; once the bug is fixed a worker completes it.
    broken["flaky"] = False
    page.get_by_role("button", name="Replay").click()
    expect(page.locator(".flash")).to_have_text("replayed 1 of 1 job")
    expect(page.locator("h2 .badge")).to_have_text("pending")
    drain(dsn)
    page.reload()
    expect(page.locator("h2 .badge")).to_have_text("succeeded")
    expect(page.locator(".facts")).to_contain_text("Finished")
    page.goto(f"{site}/rw/throughput")
    flaky_row = page.locator("#totals tr", has=page.locator("td", has_text="mail.flaky"))
    expect(flaky_row.locator("td").nth(2)).to_have_text("1")  # completed
    expect(flaky_row.locator("td").nth(4)).to_have_text("3")  # dead, in the last hour

    # Select every dead job on the page and delete them (the page asks first).
    page.goto(f"{site}/rw/jobs?status=dead")
    page.check("[data-select-all]")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Delete").click()
    expect(page.locator(".flash")).to_have_text("deleted 2 of 2 jobs")
    page.goto(f"{site}/rw/")
    expect(mail).to_have_count(0)  # nothing left in the mail queue
    expect(page.locator('tr[data-queue="later"]')).to_have_count(1)


def test_read_only_and_forged_posts_are_refused(dsn: str, site: str, page: Any) -> None:
    broken["flaky"] = True
    flaky_ids = off_thread(lambda: _defer(dsn))
    drain(dsn)
    form = {"action": "replay", "ids": str(flaky_ids[0])}

    page.goto(f"{site}/ro/jobs?status=dead")
    expect = playwright_sync.expect
    expect(page.locator("#jobs tbody tr")).to_have_count(3)
    expect(page.locator("button[name=action]")).to_have_count(0)
    expect(page.locator(".mode")).to_contain_text("read-only")
    refused = page.request.post(f"{site}/ro/actions", form=form)
    assert refused.status == 403
    assert "read-only" in refused.text()

    # The browser holds the CSRF cookie of /rw; a POST without the token is still refused.
    page.goto(f"{site}/rw/jobs/{flaky_ids[0]}")
    forged = page.request.post(f"{site}/rw/actions", form=form)
    assert forged.status == 403
    assert "CSRF" in forged.text()
    from_script = page.evaluate(
        """async ([url, id]) => (await fetch(url, {method: "POST", body: new URLSearchParams(
            {action: "replay", ids: id, csrf: "guessed"})})).status""",
        [f"{site}/rw/actions", str(flaky_ids[0])],
    )
    assert from_script == 403
    page.reload()
    expect(page.locator("h2 .badge")).to_have_text("dead")
    assert re.search(r"smtp refused message 0", page.content())
