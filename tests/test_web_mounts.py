"""The dashboard mounted anywhere: links, static files, forms and redirects stay under its mount.

Mounted at any path, named or not, several times in one app, behind a proxy prefix
(``root_path``), under a Django ASGI app. Each case is browsed through the real app, from the
entry page along every link a page makes the browser load (tests/webpages.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.testclient import TestClient
from webpages import assert_served_under, host_app

import aioq.web
from aioq.dev.pgbin import free_port


@pytest.fixture
def host_static(tmp_path: Path) -> StaticFiles:
    """The host's own static files, with a style.css and an app.js of its own."""
    (tmp_path / "style.css").write_text("/* the host's */")
    (tmp_path / "app.js").write_text("// the host's")
    return StaticFiles(directory=tmp_path)


def test_under_a_host_with_its_own_static_mount(dsn: str, host_static: StaticFiles) -> None:
    dashboard = aioq.web.app(dsn=dsn, actions=True)
    host = host_app(
        [Mount("/static", host_static, name="static"), Mount("/aioq", dashboard)], dashboard
    )
    with TestClient(host) as client:
        assert_served_under(client, "/aioq", "/aioq", dsn)
        assert client.get("/static/style.css").text == "/* the host's */"


def test_mounted_with_a_name(dsn: str) -> None:
    dashboard = aioq.web.app(dsn=dsn, actions=True)
    with TestClient(host_app([Mount("/aioq", dashboard, name="aioq")], dashboard)) as client:
        assert_served_under(client, "/aioq", "/aioq", dsn)


def test_mounted_deeper_in_nested_apps(dsn: str) -> None:
    dashboard = aioq.web.app(dsn=dsn, actions=True)
    ops = Starlette(routes=[Mount("/queue", dashboard, name="queue")])
    with TestClient(host_app([Mount("/ops", ops, name="ops")], dashboard)) as client:
        assert_served_under(client, "/ops/queue", "/ops/queue", dsn)


def test_behind_a_proxy_prefix(dsn: str) -> None:
    # The proxy forwards /proxy/... and says so in root_path; the path carries the prefix
    # (uvicorn --root-path /proxy does this, as ASGI has it).
    dashboard = aioq.web.app(dsn=dsn, actions=True)
    host = host_app([Mount("/aioq", dashboard)], dashboard)
    with TestClient(host, root_path="/proxy") as client:
        assert_served_under(client, "/proxy/aioq", "/proxy/aioq", dsn)


@pytest.mark.parametrize(
    "entry",
    [
        "/queue",  # the path carries the prefix (uvicorn --root-path /queue)
        "",  # a server that leaves it out of the path and says it in root_path alone
    ],
)
def test_served_alone_behind_a_proxy_prefix(dsn: str, entry: str) -> None:
    # `aioq web` behind a proxy that forwards /queue/... to it.
    with TestClient(aioq.web.app(dsn=dsn, actions=True), root_path="/queue") as client:
        assert_served_under(client, entry, "/queue", dsn)
        without_slash = client.get("/queue", follow_redirects=False)
        assert without_slash.status_code in (307, 308)
        assert without_slash.headers["location"].endswith("/queue/")


def test_two_dashboards_in_one_app_keep_their_own_links_and_actions(dsn: str) -> None:
    """A read-only dashboard mounted first, one with actions after it: the second's links,
    forms and redirects are its own, and its Replay works."""
    ro = aioq.web.app(dsn=dsn)
    rw = aioq.web.app(dsn=dsn, actions=True)
    host = host_app([Mount("/ro", ro), Mount("/rw", rw, name="rw")], ro, rw)
    with TestClient(host) as client:
        assert_served_under(client, "/ro", "/ro", dsn)
        assert_served_under(client, "/rw", "/rw", dsn)


# --- Django ------------------------------------------------------------------------------------

DJANGO_SETTINGS = """
SECRET_KEY = "only for this test"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1"]
ROOT_URLCONF = "urls"
INSTALLED_APPS = []
MIDDLEWARE = []
"""

DJANGO_URLS = """
from django.http import HttpResponse
from django.urls import path

urlpatterns = [path("", lambda request: HttpResponse("the django site"))]
"""

# The recipe of the dashboard's guide, as a Django project's asgi.py holds it.
DJANGO_ASGI = """
import os

from django.core.asgi import get_asgi_application

import aioq.web

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
django_app = get_asgi_application()
dashboard = aioq.web.app(dsn=os.environ["AIOQ_DSN"], actions=True)
PREFIX = "/aioq"


async def application(scope, receive, send):
    if scope["type"] == "lifespan":  # Django has none; the dashboard closes its pool on it
        await dashboard(scope, receive, send)
        return
    root = scope.get("root_path", "")
    path = scope["path"].removeprefix(root)
    if path == PREFIX or path.startswith(PREFIX + "/"):
        await dashboard({**scope, "root_path": root + PREFIX}, receive, send)
    else:
        await django_app(scope, receive, send)
"""


@pytest.fixture
def django_site(dsn: str, tmp_path: Path) -> Iterator[str]:
    """A Django project served by uvicorn (a process of its own), the dashboard at /aioq."""
    pytest.importorskip("django", reason="django is not installed (pip install -e '.[dev]')")
    (tmp_path / "settings.py").write_text(DJANGO_SETTINGS)
    (tmp_path / "urls.py").write_text(DJANGO_URLS)
    (tmp_path / "asgi.py").write_text(DJANGO_ASGI)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "asgi:application", "--app-dir", str(tmp_path),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        # Its own settings: a Django set up in this process (tests/test_django.py) leaves its
        # DJANGO_SETTINGS_MODULE in the environment.
        env={**os.environ, "AIOQ_DSN": dsn, "DJANGO_SETTINGS_MODULE": "settings"},
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx2.get(url, timeout=5)
                break
            except httpx2.TransportError:
                assert server.poll() is None, server.communicate()[1]
                assert time.monotonic() < deadline, "the Django site did not start"
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        _, errors = server.communicate(timeout=20)
    assert "Traceback" not in errors, errors


def test_under_a_django_asgi_app(dsn: str, django_site: str) -> None:
    with httpx2.Client(base_url=django_site) as client:
        assert client.get("/").text == "the django site"
        assert client.get("/aioqx").status_code == 404  # Django's: not the dashboard's prefix
        assert_served_under(client, "/aioq", "/aioq", dsn)
        without_slash = client.get("/aioq", follow_redirects=False)
        assert without_slash.status_code in (307, 308)
        assert without_slash.headers["location"].endswith("/aioq/")
