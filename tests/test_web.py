"""The dashboard over HTTP (Starlette's TestClient) against a real database: every route."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.to_thread
import asyncpg
import httpx2
import pytest
from procs import aioq_cli, assert_one_line_error, spawner
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient
from waits import until_sql, wait_for
from webpages import CSRF, add_jobs, host_app, job_ids, make_dead, queue_cells, sql, status_of

import aioq
import aioq.web
from aioq.dev.pgbin import free_port
from aioq.errors import ConfigError
from aioq.worker.history import BUCKETS


@pytest.fixture
def client(dsn: str) -> Iterator[TestClient]:
    with TestClient(aioq.web.app(dsn=dsn, actions=True, page_size=5)) as client:
        yield client


OLDEST = re.compile(r"1m (3\d|4\d|5\d)s")  # 90 s, and up to 30 s more


def test_overview_counts_each_state_per_queue(dsn: str, client: TestClient) -> None:
    ready = add_jobs(dsn, "mail", 3)
    later = add_jobs(dsn, "mail", 2)
    sql(dsn, "UPDATE aioq.jobs SET run_at = now() + interval '1 hour' WHERE id = ANY($1)", later)
    sql(dsn, "UPDATE aioq.jobs SET run_at = now() - interval '90 seconds' WHERE id = $1", ready[0])
    make_dead(dsn, add_jobs(dsn, "mail", 2), "ValueError: boom")
    sql(
        dsn,
        "UPDATE aioq.jobs SET status = 'cancelled' WHERE id = ANY($1)",
        add_jobs(dsn, "mail", 1),
    )
    running = add_jobs(dsn, "img", 2)
    sql(
        dsn,
        "UPDATE aioq.jobs SET status = 'running', attempts = 1, locked_by = 'w1', locked_at = now(),"
        " lease_expires_at = now() + CASE WHEN id = $2 THEN interval '-1 second'"
        " ELSE interval '30 seconds' END WHERE id = ANY($1)",
        running,
        running[0],
    )

    page = client.get("/")
    assert page.status_code == 200
    mail = queue_cells(page.text, "mail")
    # 90 s old when set; the page is drawn a moment later (seconds, on a loaded machine).
    assert OLDEST.fullmatch(mail.pop("oldest")), page.text
    assert mail == {
        "ready": "3",
        "scheduled": "2",
        "waiting": "0",
        "running": "0",
        "expired": "0",
        "dead": "2",
        "cancelled": "1",
        "limits": "-",
    }
    img = queue_cells(page.text, "img")
    assert (img["ready"], img["running"], img["expired"], img["dead"]) == ("0", "2", "1", "0")
    tiles = dict(re.findall(r"<span>([\w ]+)</span><strong>([^<]*)</strong>", page.text))
    assert OLDEST.fullmatch(tiles.pop("Oldest ready"))
    assert tiles == {"Ready": "3", "Running": "2", "Dead": "2", "Workers alive": "1"}
    # The worker w1 has no row in workers, and still shows through the jobs it holds: alive,
    # for one of its leases has not expired.
    assert '<td class="mono">w1</td>' in page.text
    assert "Jobs table" in page.text
    live = client.get("/live")
    assert live.status_code == 200
    assert queue_cells(live.text, "mail")["dead"] == "2"
    assert "<html" not in live.text  # the fragment the page swaps in


def test_jobs_waiting_for_a_worker_that_knows_their_task_show_on_the_overview_and_job_page(
    dsn: str, client: TestClient
) -> None:
    assert 'id="unknown-tasks"' not in client.get("/").text  # none: no section
    waiting = add_jobs(dsn, "mail", 3, unknown_since=datetime(2026, 5, 1, 12, 0, tzinfo=UTC))
    add_jobs(dsn, "mail", 2)  # jobs whose task a worker knows
    page = client.get("/").text
    [section] = re.findall(r'<table class="grid" id="unknown-tasks">.*?</table>', page, re.S)
    assert "t.mail" in section
    assert '<td class="num warn">3</td>' in section
    assert "2026-05-01 12:00" in section
    job = client.get(f"/jobs/{waiting[0]}").text
    assert 'id="unknown-task">since 2026-05-01 12:00' in job


def test_queue_limits_and_pauses_show_on_the_overview(dsn: str, client: TestClient) -> None:
    add_jobs(dsn, "mail", 2)
    for args in (
        ("set", "mail", "--max-running", "5", "--rate", "100/60s"),
        ("pause", "mail"),
        ("set", "idle", "--max-running", "2"),  # a queue with settings and no jobs
    ):
        assert aioq_cli(dsn, "queues", *args).returncode == 0, args
    page = client.get("/").text
    assert queue_cells(page, "mail")["limits"] == "paused max 5 running rate 100/1m"
    assert queue_cells(page, "idle")["limits"] == "max 2 running"
    assert queue_cells(page, "idle")["ready"] == "0"


def test_counts_stop_at_the_cap_and_say_so(dsn: str) -> None:
    add_jobs(dsn, "big", 7, priority=5)
    (low,) = add_jobs(dsn, "big", 1, priority=-1)
    sql(dsn, "UPDATE aioq.jobs SET run_at = now() - interval '2 hours' WHERE id = $1", low)
    make_dead(dsn, add_jobs(dsn, "big", 4), "boom")
    with TestClient(aioq.web.app(dsn=dsn, count_cap=3)) as client:
        cells = queue_cells(client.get("/").text, "big")
    assert (cells["ready"], cells["dead"]) == ("3+", "3+")
    assert cells["oldest"] == "2h"  # the low-priority job, far past the cap in claim order


def test_empty_database_and_missing_job(client: TestClient) -> None:
    assert "No jobs in any queue." in client.get("/").text
    assert "No matching jobs" in client.get("/jobs").text
    missing = client.get("/jobs/424242")
    assert missing.status_code == 404
    assert "is not in the table" in missing.text
    assert client.get("/jobs/abc").status_code == 404
    # Input no job can match is no error: out-of-range ids, a NUL in a filter.
    assert client.get("/jobs/99999999999999999999").status_code == 404
    assert client.get("/jobs?before=99999999999999999999").status_code == 200
    assert client.get("/jobs?q=%00&queue=a%00b").status_code == 200
    token = CSRF.search(client.get("/jobs").text)
    assert token
    data = {"csrf": token[1], "action": "delete", "ids": ["99999999999999999999", "-1", "x"]}
    done = client.post("/actions", data=data, follow_redirects=False)
    assert done.status_code == 303
    assert "deleted+0+of+0+jobs" in done.headers["location"]


def test_jobs_filters(dsn: str, client: TestClient) -> None:
    mail = add_jobs(dsn, "mail", 3)
    img = add_jobs(dsn, "img", 2)
    make_dead(dsn, [mail[0]], "SMTPError: mailbox full\nTraceback (most recent call last): ...")
    make_dead(dsn, [img[0]], "PIL.UnidentifiedImageError: cannot identify image")

    def ids(**params: str) -> list[int]:
        response = client.get("/jobs", params=params)
        assert response.status_code == 200
        return job_ids(response.text)

    assert ids() == sorted(mail + img, reverse=True)[:5]
    assert ids(queue="img") == sorted(img, reverse=True)
    assert ids(task="t.mail") == sorted(mail, reverse=True)
    assert ids(status="dead") == sorted([mail[0], img[0]], reverse=True)
    assert ids(status="pending", queue="mail") == sorted(mail[1:], reverse=True)
    assert ids(q="MAILBOX") == [mail[0]]  # case-insensitive text in last_error
    assert ids(status="dead", q="image") == [img[0]]
    assert ids(status="nonsense") == []
    assert ids(before="abc") == ids()  # a bad cursor is the first page


def test_jobs_keyset_pages_cover_every_job_once(dsn: str, client: TestClient) -> None:
    every = add_jobs(dsn, "q", 23)
    seen: list[int] = []
    url: str | None = "/jobs?queue=q"
    while url is not None:
        html = client.get(url).text
        seen += job_ids(html)
        older = re.search(r'href="([^"]+)" rel="next"', html)
        url = older[1].replace("&amp;", "&") if older else None
    assert seen == sorted(every, reverse=True)


def test_a_page_reads_a_bounded_window_and_goes_on_below_it(dsn: str) -> None:
    add_jobs(dsn, "q", 30)
    rare = add_jobs(dsn, "rare", 1)
    add_jobs(dsn, "q", 30)
    with TestClient(aioq.web.app(dsn=dsn, window=20, page_size=5)) as client:
        first = client.get("/jobs?queue=rare").text
        assert job_ids(first) == []
        assert "among the 20 newest" in first
        found: list[int] = []
        url = re.search(r'href="([^"]+)" rel="next"', first)
        while url is not None and not found:
            html = client.get(url[1].replace("&amp;", "&")).text
            found = job_ids(html)
            url = re.search(r'href="([^"]+)" rel="next"', html)
    assert found == rare


def test_job_detail_shows_args_error_and_worker(dsn: str, client: TestClient) -> None:
    (job,) = add_jobs(dsn, "mail", 1)
    sql(dsn, """UPDATE aioq.jobs SET args = '{"to": "a@example.com", "n": 2}' WHERE id = $1""", job)
    error = 'Traceback (most recent call last):\n  File "tasks.py", line 3\nKeyError: "<to>"'
    make_dead(dsn, [job], error)
    page = client.get(f"/jobs/{job}")
    assert page.status_code == 200
    assert "a@example.com" in page.text
    assert "KeyError: &#34;&lt;to&gt;&#34;" in page.text  # escaped, whole
    assert 'File "tasks.py", line 3'.replace('"', "&#34;") in page.text
    assert 'value="replay"' in page.text
    assert 'value="delete"' in page.text
    assert 'value="cancel"' not in page.text  # a dead job is not cancelled


def test_a_succeeded_job_is_found_in_the_archive(dsn: str, client: TestClient) -> None:
    sql(
        dsn,
        "INSERT INTO aioq.archive (id, queue, task, args, priority, attempts, max_attempts,"
        " worker, created_at, started_at, finished_at) VALUES (77, 'mail', 'mail.send',"
        """ '{"to": "z@example.com"}', 0, 1, 5, 'host-a:12:abc', now(), now(), now())""",
    )
    page = client.get("/jobs/77")
    assert page.status_code == 200
    assert '<span class="badge succeeded">succeeded</span>' in page.text
    assert "host-a:12:abc" in page.text  # the worker that ran it
    assert "<dt>Finished</dt>" in page.text
    assert "<button" not in page.text  # nothing to do to a finished job
    listing = client.get("/jobs").text
    assert '<option value="succeeded"' not in listing  # the list reads the jobs table only
    assert '<option value="dead"' in listing


def post(client: TestClient, action: str, ids: list[int], **extra: str) -> Any:
    token = CSRF.search(client.get("/jobs").text)
    assert token
    data = {"csrf": token[1], "action": action, "ids": [str(i) for i in ids], **extra}
    return client.post("/actions", data=data, follow_redirects=False)


def test_actions_replay_cancel_delete(dsn: str, client: TestClient) -> None:
    dead = add_jobs(dsn, "mail", 3)
    make_dead(dsn, dead, "boom")
    pending = add_jobs(dsn, "mail", 3)

    done = post(client, "replay", [dead[0], pending[0]], next="/jobs?status=dead")
    assert done.status_code == 303
    assert done.headers["location"].startswith("/jobs?status=dead&done=replayed+1+of+2")
    assert status_of(dsn, dead[0]) == "pending"
    assert status_of(dsn, pending[0]) == "pending"
    # The button's old value, from a page loaded before an upgrade, replays too.
    make_dead(dsn, [dead[0]], "boom")
    old = post(client, "retry", [dead[0]])
    assert "done=replayed+1+of+1+job" in old.headers["location"]
    assert status_of(dsn, dead[0]) == "pending"

    cancelled = post(client, "cancel", [*pending[1:], dead[1]])
    assert cancelled.status_code == 303
    assert "done=cancelled+2+of+3+jobs" in cancelled.headers["location"]
    assert [status_of(dsn, i) for i in pending[1:]] == ["cancelled", "cancelled"]
    assert status_of(dsn, dead[1]) == "dead"  # a dead job is not cancelled
    assert job_ids(client.get("/jobs?status=cancelled").text) == sorted(pending[1:], reverse=True)

    running = add_jobs(dsn, "mail", 1)
    sql(
        dsn,
        "UPDATE aioq.jobs SET status = 'running', locked_by = 'w', lease_expires_at = now()"
        " + interval '1 minute' WHERE id = $1",
        running[0],
    )
    assert post(client, "delete", [dead[1], dead[2], running[0], pending[1]]).status_code == 303
    assert [status_of(dsn, i) for i in [*dead[1:], pending[1]]] == [None, None, None]
    assert status_of(dsn, running[0]) == "running"  # its worker owns it

    shown = client.get(done.headers["location"])
    assert "replayed 1 of 2 jobs" in shown.text
    assert "frame-ancestors 'none'" in shown.headers["content-security-policy"]
    assert shown.headers["x-frame-options"] == "DENY"
    spoofed = client.get("/jobs", params={"done": "Your session expired, call +1 555"})
    assert "session expired" not in spoofed.text


def test_actions_refuse_forged_and_foreign_requests(dsn: str, client: TestClient) -> None:
    dead = add_jobs(dsn, "mail", 1)
    make_dead(dsn, dead, "boom")
    client.get("/")  # the cookie
    forged = client.post("/actions", data={"action": "replay", "ids": str(dead[0])})
    assert forged.status_code == 403
    assert "CSRF" in forged.text
    wrong = client.post("/actions", data={"csrf": "x" * 43, "action": "replay", "ids": dead})
    assert wrong.status_code == 403
    client.cookies.clear()
    token = CSRF.search(client.get("/jobs").text)
    assert token
    client.cookies.clear()  # a token from the page without the cookie it goes with
    stolen = client.post("/actions", data={"csrf": token[1], "action": "replay", "ids": dead})
    assert stolen.status_code == 403
    assert status_of(dsn, dead[0]) == "dead"

    bad = post(client, "explode", dead)
    assert bad.status_code == 400
    away = post(client, "replay", dead, next="//evil.example/x")
    assert away.headers["location"].startswith("/?done=")  # never an open redirect
    assert client.get("/actions").status_code == 405


def test_read_only_shows_no_buttons_and_refuses_posts(dsn: str) -> None:
    dead = add_jobs(dsn, "mail", 1)
    make_dead(dsn, dead, "boom")
    with TestClient(aioq.web.app(dsn=dsn)) as client:
        assert "read-only" in client.get("/").text
        for path in ("/jobs", f"/jobs/{dead[0]}"):
            html = client.get(path).text
            assert "<button name=" not in html
            assert 'name="ids"' not in html
        page = client.get("/jobs")
        assert CSRF.search(page.text) is None
        assert "set-cookie" not in page.headers  # no token, no cookie
        refused = client.post("/actions", data={"action": "replay", "ids": dead})
        assert refused.status_code == 403
        assert "read-only" in refused.text
    assert status_of(dsn, dead[0]) == "dead"


@pytest.mark.parametrize("asynchronous", [False, True])
def test_authorize_hook_guards_every_route(dsn: str, asynchronous: bool) -> None:
    def allow(request: Any) -> bool:
        return bool(request.headers.get("x-admin") == "yes")

    async def allow_async(request: Any) -> bool:
        return allow(request)

    hook = allow_async if asynchronous else allow
    (job,) = add_jobs(dsn, "mail", 1)
    with TestClient(aioq.web.app(dsn=dsn, actions=True, authorize=hook)) as client:
        paths = ("/", "/live", "/jobs", f"/jobs/{job}", "/throughput", "/static/app.js",
                 "/static/style.css")  # fmt: skip
        for path in paths:
            assert client.get(path).status_code == 403, path
            assert client.get(path, headers={"x-admin": "yes"}).status_code == 200, path
        # Nothing answers before the hook: not even "no such page".
        for path in ("/static/nothing.css", "/nowhere"):
            assert client.get(path).status_code == 403, path
            assert client.get(path, headers={"x-admin": "yes"}).status_code == 404, path
        refused = client.post("/actions", data={"action": "cancel", "ids": job})
        assert refused.status_code == 403
    assert status_of(dsn, job) == "pending"


PAGES = ("/", "/live", "/jobs", "/workflows", "/throughput", "/static/app.js", "/nowhere")


def test_a_foreign_host_name_is_refused_before_any_page_token_or_action(
    dsn: str, client: TestClient
) -> None:
    """DNS rebinding: a page on evil.example, its name re-pointed at the dashboard's address,
    reaches it with `Host: evil.example`. Without `authorize` the dashboard answers its own
    names only: a 400 before any page, token or action."""
    (dead,) = add_jobs(dsn, "mail", 1)
    make_dead(dsn, [dead], "boom")
    token = CSRF.search(client.get("/jobs").text)  # the server's own name (TestClient's)
    assert token
    evil = {"host": "evil.example:8080"}
    for path in (*PAGES, f"/jobs/{dead}"):
        refused = client.get(path, headers=evil)
        assert refused.status_code == 400, path
        assert refused.text.startswith("refused: 'evil.example:8080' is not a host name this")
        assert "--allowed-host" in refused.text
        assert CSRF.search(refused.text) is None
        assert "set-cookie" not in refused.headers
    form = {"csrf": token[1], "action": "delete", "ids": str(dead)}
    deleted = client.post("/actions", data=form, headers=evil, follow_redirects=False)
    assert deleted.status_code == 400
    assert status_of(dsn, dead) == "dead"
    for odd in ("evil.example", "127.0.0.1.evil.example", "localhost.evil.example", "a b"):
        assert client.get("/", headers={"host": odd}).status_code == 400, odd
    # The same form under the dashboard's own name works.
    assert client.post("/actions", data=form, follow_redirects=False).status_code == 303
    assert status_of(dsn, dead) is None


def test_allowed_hosts_name_the_hosts_a_proxy_forwards(dsn: str) -> None:
    allowed = ["queue.example.com", ".corp.example", "10.1.2.3", "::1"]
    with TestClient(aioq.web.app(dsn=dsn, allowed_hosts=allowed)) as client:
        for host in ("queue.example.com", "QUEUE.example.com.:443", "corp.example",
                     "a.b.corp.example:80", "10.1.2.3:8080", "[::1]", "testserver"):  # fmt: skip
            assert client.get("/", headers={"host": host}).status_code == 200, host
        for host in ("example.com", "xcorp.example", "queue.example.com.evil", "10.1.2.4"):
            assert client.get("/", headers={"host": host}).status_code == 400, host
    with TestClient(aioq.web.app(dsn=dsn, allowed_hosts=["*"])) as client:
        assert client.get("/", headers={"host": "anything.example"}).status_code == 200
    # With authorize, the host app checks its hosts (unless allowed_hosts is given too).
    with TestClient(aioq.web.app(dsn=dsn, authorize=lambda request: True)) as client:
        assert client.get("/", headers={"host": "queue.example.com"}).status_code == 200
    both = aioq.web.app(dsn=dsn, authorize=lambda request: True, allowed_hosts=["a.example"])
    with TestClient(both) as client:
        assert client.get("/", headers={"host": "a.example"}).status_code == 200
        assert client.get("/", headers={"host": "b.example"}).status_code == 400
    for bad in ("http://queue.example.com", "queue.example.com:443", "a/b", "", "*.example"):
        with pytest.raises(ConfigError, match="allowed_hosts"):
            aioq.web.app(dsn=dsn, allowed_hosts=[bad])
    with pytest.raises(ConfigError, match="a list of host names"):
        aioq.web.app(dsn=dsn, allowed_hosts="queue.example.com")


def test_aioq_web_answers_its_own_names_only(dsn: str, tmp_path: Path) -> None:
    """`aioq web --actions` on 127.0.0.1: its address and localhost, and the names given with
    --allowed-host; a page reached through any other name gets a 400, actions included."""
    (dead,) = add_jobs(dsn, "mail", 1)
    make_dead(dsn, [dead], "boom")
    port = free_port()
    with spawner(dsn) as start, httpx2.Client() as http:
        start("web", "--port", str(port), "--actions", "--allowed-host", "queue.example",
              cwd=tmp_path)  # fmt: skip
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            try:
                return http.get(f"{url}/jobs").status_code == 200
            except httpx2.TransportError:
                return False

        wait_for(answers, "aioq web")
        token = CSRF.search(http.get(f"{url}/jobs/{dead}").text)
        assert token
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.nip.io:{port}"):
            page = http.get(f"{url}/jobs/{dead}", headers={"host": host})
            assert page.status_code == 400, host
            assert "is not a host name this dashboard answers to" in page.text
            form = {"csrf": token[1], "action": "delete", "ids": str(dead)}
            post = http.post(f"{url}/actions", data=form, headers={"host": host})
            assert post.status_code == 400, host
        assert status_of(dsn, dead) == "dead"
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "queue.example"):
            assert http.get(f"{url}/jobs", headers={"host": host}).status_code == 200, host
    bad = aioq_cli(dsn, "web", "--allowed-host", "http://queue.example/")
    assert_one_line_error(bad, "--allowed-host: 'http://queue.example/' is not a host name")


def test_mounted_in_a_host_app_with_a_pool(dsn: str) -> None:
    async def make_pool() -> asyncpg.Pool:
        return await asyncpg.create_pool(dsn, min_size=1, max_size=2)

    host = Starlette()
    with TestClient(host) as client:
        pool = client.portal.call(make_pool)  # on the client's event loop
        try:
            host.mount("/ops/aioq", aioq.web.app(pool=pool, actions=True))
            add_jobs(dsn, "mail", 1)
            page = client.get("/ops/aioq/")
            assert page.status_code == 200
            assert 'href="/ops/aioq/jobs"' in page.text
            assert 'href="/ops/aioq/static/style.css"' in page.text
            assert client.get("/ops/aioq/static/app.js").status_code == 200
            assert "Path=/ops/aioq;" in page.headers["set-cookie"]
            assert client.get("/ops/aioq/jobs?queue=mail").status_code == 200
        finally:
            client.portal.call(pool.close)


def test_a_slow_statement_is_cut_by_the_timeout(dsn: str) -> None:
    # Hold a lock the overview's table-size read waits for: the page gives up, it never hangs.
    async def scenario() -> None:
        blocker = await asyncpg.connect(dsn)
        try:
            await blocker.execute("BEGIN; LOCK TABLE aioq.jobs IN ACCESS EXCLUSIVE MODE")
            await asyncio.to_thread(check)
        finally:
            await blocker.close()

    def check() -> None:
        with TestClient(aioq.web.app(dsn=dsn, statement_timeout=0.3)) as client:
            page = client.get("/")
        assert page.status_code == 503
        assert "QueryCanceledError" in page.text or "statement timeout" in page.text

    asyncio.run(scenario())


def test_bad_configuration_names_the_option(dsn: str) -> None:
    with pytest.raises(ConfigError, match="dsn"):
        aioq.web.app()
    with pytest.raises(ConfigError, match="refresh"):
        aioq.web.app(dsn=dsn, refresh=0.5)
    with pytest.raises(ConfigError, match="page_size"):
        aioq.web.app(dsn=dsn, page_size=0)
    with pytest.raises(ConfigError, match="schema"):
        aioq.web.app(dsn=dsn, schema="no-such schema")
    with pytest.raises(TypeError):
        aioq.web.app(dsn=dsn, colour="blue")


def test_aioq_web_serves_on_localhost_until_interrupted(dsn: str, tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aioq", "web", "--port", str(port), "--actions"],
        env={**os.environ, "AIOQ_DSN": dsn},
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stderr is not None
        started = proc.stderr.readline()
        assert f"aioq dashboard on http://127.0.0.1:{port}/ (actions enabled)" in started
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/jobs", timeout=5) as page:
                    body = page.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "aioq web did not answer"
                time.sleep(0.1)
        assert "actions enabled" in body
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=20)
        assert proc.returncode == 0, rest
        assert "Traceback" not in rest
    finally:
        proc.kill()
        proc.communicate()


def test_aioq_web_errors(dsn: str) -> None:
    assert_one_line_error(aioq_cli(None, "web"), "no database: pass --dsn or set AIOQ_DSN")
    assert_one_line_error(aioq_cli(dsn, "web", "--refresh", "0.5"), "refresh")
    help_text = aioq_cli(None, "web", "--help").stdout
    assert "default: 127.0.0.1" in help_text


@pytest.mark.anyio
async def test_actions_race_busy_workers_without_touching_a_running_job(
    dsn: str, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """Cancel and delete from the page while three workers (short leases, one hard-cancelled)
    drain the queue: nothing is lost, and no job the page removed ever finished a run."""
    starts: dict[int, set[str]] = {}
    ends: set[int] = set()

    @registry.task(name="work", lease=1.0)
    async def work(n: int) -> None:
        job = aioq.current_job()
        starts.setdefault(job.id, set()).add(job.worker_id)
        await anyio.sleep(0.01 * (n % 5))
        ends.add(job.id)

    conn = await asyncpg.connect(dsn)
    try:
        ids = await work.defer_many(conn, [{"n": i} for i in range(400)])
        removed: set[int] = set()

        def operator() -> None:
            with TestClient(aioq.web.app(dsn=dsn, actions=True, page_size=40)) as client:
                for round_ in range(12):
                    page = client.get("/jobs?status=pending")
                    found = job_ids(page.text)
                    if not found:
                        break
                    token = CSRF.search(page.text)
                    assert token
                    action = "cancel" if round_ % 2 else "delete"
                    done = client.post(
                        "/actions",
                        data={"csrf": token[1], "action": action, "ids": found[::2]},
                        follow_redirects=False,
                    )
                    assert done.status_code == 303
                    # Gone now: removed by the page, or claimed and completed meanwhile (its
                    # run ended before its completion was written, so it is in `ends` by now).
                    gone = {i for i in found[::2] if status_of(dsn, i) in (None, "cancelled")}
                    removed.update(gone - set(ends))

        workers = [
            make_worker(concurrency=4, heartbeat_interval=0.2, poll_interval=0.05) for _ in range(3)
        ]
        async with workers[0], workers[1]:
            with anyio.CancelScope() as hard:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(workers[2].run)
                    await anyio.to_thread.run_sync(operator)
                    hard.cancel()  # the third worker goes away mid-drain
            await until_sql(
                conn,
                "SELECT NOT EXISTS (SELECT FROM aioq.jobs WHERE status IN ('pending', 'running'))",
            )
    finally:
        await conn.close()

    assert removed, "the operator removed nothing: the race was not exercised"
    assert set(ids) == ends | removed  # every job finished or was removed by the page
    hard_id = workers[2].id
    strict = {i for i in removed if hard_id not in starts.get(i, set())}
    assert not strict & ends  # a job the page removed never finished a run


def test_a_read_only_role_with_the_documented_grants_sees_every_page(
    admin_dsn: str, dsn: str
) -> None:
    guide = (Path(__file__).parents[1] / "docs" / "operations-and-cli.md").read_text()
    grant = re.search(r"A read-only\s+dashboard needs only `(GRANT SELECT ON [^`]+)`", guide)
    assert grant, "docs/operations-and-cli.md: the read-only dashboard's grants"
    (job,) = add_jobs(dsn, "mail", 1)
    make_dead(dsn, [job], "boom")
    name, password = f"aioq_ro_{secrets.token_hex(4)}", secrets.token_hex(8)
    sql(admin_dsn, f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
    try:
        sql(dsn, f"GRANT USAGE ON SCHEMA aioq TO {name}")
        sql(dsn, f"{grant[1]} TO {name}")
        parts = urlsplit(dsn)
        as_role = urlunsplit(
            parts._replace(netloc=f"{name}:{password}@{parts.hostname}:{parts.port}")
        )
        with TestClient(aioq.web.app(dsn=as_role)) as client:
            for path in ("/", "/live", "/jobs", "/jobs?status=dead", f"/jobs/{job}", "/jobs/999",
                         "/throughput", "/throughput?range=day&queue=mail"):  # fmt: skip
                assert client.get(path).status_code in (200, 404), path
            assert "boom" in client.get(f"/jobs/{job}").text
    finally:
        sql(dsn, f"DROP OWNED BY {name}")
        sql(admin_dsn, f"DROP ROLE {name}")


@pytest.mark.anyio
async def test_a_running_job_is_cancelled_from_its_page_and_shows_its_progress(
    dsn: str, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    started = anyio.Event()

    @registry.task(name="slow")
    async def slow() -> None:
        await aioq.current_job().set_progress(0.25, note="step 1 of 4")
        started.set()
        await anyio.sleep(60)

    @registry.task(name="answer", result_ttl=600)
    async def answer() -> dict[str, int]:
        return {"answer": 42}

    conn = await asyncpg.connect(dsn)
    try:
        job = await slow.defer(conn)
        done = await answer.defer(conn)
        async with make_worker(concurrency=2, heartbeat_interval=0.2):
            with anyio.fail_after(30):
                await started.wait()

            def operator() -> None:
                with TestClient(aioq.web.app(dsn=dsn, actions=True)) as client:
                    page = client.get(f"/jobs/{job}")
                    assert '<progress id="progress" max="1" value="0.25">' in page.text
                    assert "step 1 of 4" in page.text
                    assert 'value="cancel"' in page.text  # a running job can be cancelled
                    assert 'value="delete"' not in page.text  # but not deleted
                    assert ">25%</span>" in client.get("/jobs?status=running").text
                    token = CSRF.search(page.text)
                    assert token
                    data = {"csrf": token[1], "action": "cancel", "ids": str(job)}
                    sent = client.post("/actions", data=data, follow_redirects=False)
                    assert "cancelled+1+of+1+job+%281+stopping%29" in sent.headers["location"]

            await anyio.to_thread.run_sync(operator)
            await until_sql(conn, "SELECT status = 'cancelled' FROM aioq.jobs WHERE id = $1", job)
            await until_sql(conn, "SELECT NOT EXISTS (SELECT FROM aioq.jobs WHERE id = $1)", done)

        def check() -> None:
            with TestClient(aioq.web.app(dsn=dsn, actions=True)) as client:
                page = client.get(f"/jobs/{job}").text
                assert '<span class="badge cancelled">cancelled</span>' in page
                assert 'value="delete"' in page
                stored = client.get(f"/jobs/{done}").text
                assert '<span class="badge succeeded">succeeded</span>' in stored
                assert "{&#34;answer&#34;:42}" in stored.replace(" ", "")

        await anyio.to_thread.run_sync(check)
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_a_dead_job_shows_the_worker_it_last_ran_on(
    dsn: str, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task(name="doomed", max_attempts=1)
    async def doomed() -> None:
        raise RuntimeError("no luck")

    conn = await asyncpg.connect(dsn)
    try:
        failed = await doomed.defer(conn)
        # A worker that vanished holding the last attempt: the reaper buries it.
        lost = await conn.fetchval(
            "INSERT INTO aioq.jobs (task, status, attempts, max_attempts, locked_by,"
            " lease_expires_at) VALUES ('doomed', 'running', 1, 1, 'host-b:99:gone',"
            " now() - interval '1 second') RETURNING id"
        )
        worker = make_worker(reaper_interval=0.1)
        async with worker:
            await until_sql(conn, "SELECT count(*) = 2 FROM aioq.jobs WHERE status = 'dead'")
        for job, ran_on in ((failed, worker.id), (lost, "host-b:99:gone")):
            found = await aioq.admin.get_job(conn, job)
            assert found is not None
            assert (found.locked_by, found.last_worker) == (None, ran_on)

        def check() -> None:
            with TestClient(aioq.web.app(dsn=dsn)) as client:
                for job, ran_on in ((failed, worker.id), (lost, "host-b:99:gone")):
                    page = client.get(f"/jobs/{job}").text
                    assert '<span class="badge dead">dead</span>' in page
                    assert f'<dt>Last worker</dt><dd class="mono">{ran_on}</dd>' in page

        await anyio.to_thread.run_sync(check)
    finally:
        await conn.close()


def test_the_jobs_page_says_what_its_buttons_act_on(dsn: str, client: TestClient) -> None:
    dead = add_jobs(dsn, "mail", 7)
    make_dead(dsn, dead, "boom")
    page = client.get("/jobs", params={"status": "dead", "queue": "mail"}).text
    assert len(job_ids(page)) == 5  # one page of the seven
    assert "act on the jobs ticked on this page only" in page
    assert "<code>aioq jobs replay --dead --queue mail</code>" in page
    # The command is copied into a shell: a filter value is quoted for it.
    odd = client.get("/jobs", params={"status": "dead", "task": "a b;rm"}).text
    assert "<code>aioq jobs replay --dead --task &#39;a b;rm&#39;</code>" in odd
    # The CLI cannot filter by error text, and replays only dead jobs: no command then.
    for params in ({"status": "dead", "q": "boom"}, {"status": "pending"}, {}):
        assert "aioq jobs replay" not in client.get("/jobs", params=params).text
    # What the command says is what the CLI does: every dead job of the queue, past the page.
    replayed = aioq_cli(dsn, "jobs", "replay", "--dead", "--queue", "mail")
    assert replayed.returncode == 0, replayed
    assert {status_of(dsn, i) for i in dead} == {"pending"}


# --- the trust boundary: the CSRF token, its cookie, the secret --------------------------------


def set_cookies(response: Any) -> dict[str, list[str]]:
    """The cookies a response sets: name -> its attributes, lowercased (value left out)."""
    found = {}
    for header in response.headers.get_list("set-cookie"):
        first, *attributes = (part.strip() for part in header.split(";"))
        found[first.split("=", 1)[0]] = sorted(a.lower() for a in attributes if a)
    return found


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_planted_cookie_and_the_same_value_in_the_form_are_refused(dsn: str, scheme: str) -> None:
    """Someone who can set a cookie for the dashboard's site (a sibling subdomain, a plain-http
    page of it) cannot pick the token: it is signed with the dashboard's secret."""
    (job,) = add_jobs(dsn, "mail", 1)
    planted = secrets.token_urlsafe(32)
    with TestClient(
        aioq.web.app(dsn=dsn, actions=True), base_url=f"{scheme}://testserver"
    ) as client:
        for name in ("aioq_csrf", "__Host-aioq_csrf"):
            client.cookies.set(name, planted)
        form = {"csrf": planted, "action": "delete", "ids": str(job)}
        forged = client.post("/actions", data=form, follow_redirects=False)
        assert forged.status_code == 403
        assert "CSRF" in forged.text
    assert status_of(dsn, job) == "pending"


def test_the_csrf_cookie_over_https_is_host_only_secure_and_strict(dsn: str) -> None:
    (dead,) = add_jobs(dsn, "mail", 1)
    make_dead(dsn, [dead], "boom")
    dashboard = aioq.web.app(dsn=dsn, actions=True)
    host = host_app([Mount("/aioq", dashboard)], dashboard)
    with TestClient(host, base_url="https://testserver") as client:
        page = client.get("/aioq/jobs?status=dead")
        # __Host-: only a secure page of this very host may set it, for the whole host (Path=/).
        assert set_cookies(page) == {
            "__Host-aioq_csrf": ["httponly", "path=/", "samesite=strict", "secure"]
        }
        token = CSRF.search(page.text)
        assert token
        done = client.post(
            "/aioq/actions",
            data={"csrf": token[1], "action": "replay", "ids": str(dead)},
            follow_redirects=False,
        )
        assert done.status_code == 303, done.text
        assert set_cookies(client.get("/aioq/jobs")) == {}  # kept, not replaced
    assert status_of(dsn, dead) == "pending"
    with TestClient(host) as client:  # plain http (a local dashboard): no Secure, its own path
        cookies = set_cookies(client.get("/aioq/jobs"))
    assert cookies == {"aioq_csrf": ["httponly", "path=/aioq", "samesite=strict"]}


def test_tokens_hold_across_processes_that_share_the_secret_and_nowhere_else(dsn: str) -> None:
    """Two processes of one dashboard (two app instances here) accept each other's tokens when
    given the same secret; without one each process has its own; another mount never does."""
    (dead,) = add_jobs(dsn, "mail", 1)
    make_dead(dsn, [dead], "boom")
    secret = secrets.token_urlsafe(32)

    def retried_by(first: Starlette, second: Starlette) -> int:
        with TestClient(first) as one, TestClient(second) as two:
            page = one.get(f"/jobs/{dead}")
            token = CSRF.search(page.text)
            assert token
            two.cookies = one.cookies
            form = {"csrf": token[1], "action": "replay", "ids": str(dead)}
            return int(two.post("/actions", data=form, follow_redirects=False).status_code)

    def process(**options: Any) -> Starlette:
        return aioq.web.app(dsn=dsn, actions=True, **options)

    assert retried_by(process(), process()) == 403  # a random secret of each
    # The same secret, another mount: /a's token is no key to /b.
    a, b = process(secret=secret), process(secret=secret)
    with (
        TestClient(host_app([Mount("/a", a)], a)) as one,
        TestClient(host_app([Mount("/b", b)], b)) as two,
    ):
        token = CSRF.search(one.get(f"/a/jobs/{dead}").text)
        assert token
        for name, value in one.cookies.items():
            two.cookies.set(name, value, path="/b")
        form = {"csrf": token[1], "action": "replay", "ids": str(dead)}
        assert two.post("/b/actions", data=form, follow_redirects=False).status_code == 403
    assert status_of(dsn, dead) == "dead"
    assert retried_by(process(secret=secret), process(secret=secret)) == 303
    assert status_of(dsn, dead) == "pending"
    for bad in ("short", 12345):
        with pytest.raises(ConfigError, match="secret"):
            process(secret=bad)


def test_a_cross_site_post_is_refused_even_with_a_valid_token(dsn: str, client: TestClient) -> None:
    (dead,) = add_jobs(dsn, "mail", 1)
    make_dead(dsn, [dead], "boom")
    token = CSRF.search(client.get("/jobs").text)
    assert token
    form = {"csrf": token[1], "action": "replay", "ids": str(dead)}
    for site in ("cross-site", "same-site"):  # what the browser says of the page that posted
        refused = client.post("/actions", data=form, headers={"sec-fetch-site": site})
        assert refused.status_code == 403, site
    assert status_of(dsn, dead) == "dead"
    done = client.post(
        "/actions", data=form, headers={"sec-fetch-site": "same-origin"}, follow_redirects=False
    )
    assert done.status_code == 303
    assert status_of(dsn, dead) == "pending"


def test_aioq_web_processes_given_one_secret_accept_each_others_tokens(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `aioq web` behind one address (a load balancer): AIOQ_WEB_SECRET makes a form served
    by one good at the other."""
    (dead,) = add_jobs(dsn, "mail", 1)
    make_dead(dsn, [dead], "boom")
    monkeypatch.setenv("AIOQ_WEB_SECRET", secrets.token_urlsafe(32))
    ports = [free_port(), free_port()]
    with spawner(dsn) as start:
        for port in ports:
            start("web", "--port", str(port), "--actions", cwd=tmp_path)
        with httpx2.Client() as http:

            def answers(port: int) -> bool:
                try:
                    return http.get(f"http://127.0.0.1:{port}/jobs").status_code == 200
                except httpx2.TransportError:
                    return False

            for port in ports:
                wait_for(lambda port=port: answers(port), f"aioq web on port {port}")
            token = CSRF.search(http.get(f"http://127.0.0.1:{ports[0]}/jobs/{dead}").text)
            assert token
            done = http.post(
                f"http://127.0.0.1:{ports[1]}/actions",
                data={"csrf": token[1], "action": "replay", "ids": str(dead)},
            )
            assert done.status_code == 303, done.text
    assert status_of(dsn, dead) == "pending"
    monkeypatch.setenv("AIOQ_WEB_SECRET", "short")
    assert_one_line_error(aioq_cli(dsn, "web"), "AIOQ_WEB_SECRET")


# --- workers alive ------------------------------------------------------------------------------


def worker_dots(html: str) -> dict[str, str]:
    """Each worker of the overview and its dot: ok (alive) or gone."""
    return dict(
        (worker, dot)
        for dot, worker in re.findall(
            r'<span class="dot (\w+)"[^>]*></span></td>\s*<td class="mono">([^<]+)</td>', html
        )
    )


def tiles(html: str) -> dict[str, str]:
    return dict(re.findall(r"<span>([\w ]+)</span><strong>([^<]*)</strong>", html))


def test_workers_alive_are_those_seen_lately_or_holding_a_live_lease(dsn: str) -> None:
    """A worker writes its row every stats_interval (60 s): seen within stale_after (90 s, one
    and a half intervals) it is alive; a worker that writes no row is alive while it holds a
    lease that has not expired."""
    sql(
        dsn,
        "INSERT INTO aioq.workers (id, host, pid, queues, concurrency, last_seen) VALUES"
        " ('w-fresh', 'h', 1, '{default}', 4, now() - interval '10 seconds'),"
        " ('w-late', 'h', 2, '{default}', 4, now() - interval '80 seconds'),"
        " ('w-killed', 'h', 3, '{default}', 4, now() - interval '100 seconds'),"
        " ('w-long-gone', 'h', 4, '{default}', 4, now() - interval '170 seconds')",
    )
    holders = {"w-killed": "-1 second", "w-leased": "20 seconds", "w-lapsed": "-1 second"}
    for worker, lease_left in holders.items():
        sql(
            dsn,
            "UPDATE aioq.jobs SET status = 'running', attempts = 1, locked_by = $2,"
            " locked_at = now(), lease_expires_at = now() + $3::text::interval WHERE id = ANY($1)",
            add_jobs(dsn, "mail", 1),
            worker,
            lease_left,
        )
    with TestClient(aioq.web.app(dsn=dsn)) as client:
        page = client.get("/").text
    assert worker_dots(page) == {
        "w-fresh": "ok", "w-late": "ok", "w-killed": "gone", "w-long-gone": "gone",
        "w-leased": "ok", "w-lapsed": "gone",
    }  # fmt: skip
    assert tiles(page)["Workers alive"] == "3"


def test_a_killed_worker_stops_counting_as_alive(dsn: str, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(
        "import asyncio, sys\n"
        "import aioq\n"
        "worker = aioq.Worker(dsn=sys.argv[1], registry=aioq.Registry(), stats_interval=0.2)\n"
        "asyncio.run(worker.run())\n"
    )
    proc = subprocess.Popen([sys.executable, str(script), dsn], stderr=subprocess.PIPE, text=True)
    try:
        with TestClient(aioq.web.app(dsn=dsn, stale_after=2.0)) as client:

            def alive() -> str:
                return tiles(client.get("/").text)["Workers alive"]

            wait_for(lambda: alive() == "1", "the worker to show alive")
            proc.kill()  # SIGKILL: no clean stop, its row stays behind
            proc.communicate()
            wait_for(lambda: alive() == "0", "the killed worker to show gone")
            assert list(worker_dots(client.get("/").text).values()) == ["gone"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_read_only_dashboard_shows_the_command_that_retries_a_dead_filter(dsn: str) -> None:
    make_dead(dsn, add_jobs(dsn, "mail", 2), "boom")
    with TestClient(aioq.web.app(dsn=dsn)) as client:
        page = client.get("/jobs", params={"status": "dead", "queue": "mail"}).text
    assert "<code>aioq jobs replay --dead --queue mail</code>" in page
    assert "<button name=" not in page


def test_waits_past_the_last_bucket_show_in_both_views(dsn: str) -> None:
    """The history's sums read every bucket of the histograms the workers write."""
    past_the_last = [0] * len(BUCKETS) + [5]  # five jobs waited more than BUCKETS[-1]
    quick = [5] + [0] * len(BUCKETS)
    for table, worker in (("stats_history", "'w', "), ("stats_rollup", "")):
        sql(
            dsn,
            f"INSERT INTO aioq.{table} VALUES (now(), {worker}'mail', 'mail.send', 5, 0, 0, $1, $2)",
            past_the_last,
            quick,
        )
    with TestClient(aioq.web.app(dsn=dsn)) as client:
        for view in ("hour", "day"):
            totals = client.get(f"/throughput?range={view}").text.split('id="totals"')[1]
            cells = re.findall(r'<td class="num">([^<]*)</td>', totals)
            assert cells[-4:] == ["&gt;1h", "&gt;1h", "5ms", "5ms"], (view, cells)
