"""The examples run for real: the FastAPI app through its ASGI lifespan, the quickstart as a user runs it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import asyncpg
import pytest
from fastapi.testclient import TestClient
from waits import wait_for

import aioq
from examples.fastapi_app import create_app

ROOT = Path(__file__).resolve().parent.parent


def test_fastapi_lifespan_worker_processes_job_deferred_with_the_row(dsn: str) -> None:
    # TestClient as a context manager runs the app's lifespan: pool, schema, worker.
    with TestClient(create_app(dsn)) as client:
        created = client.post("/users", json={"name": "ada"})
        assert created.status_code == 201
        job_id = created.json()["job_id"]

        def done() -> bool:
            state = client.get(f"/jobs/{job_id}").json()["state"]
            assert state in ("pending", "running", "done"), state
            return bool(state == "done")

        wait_for(done, f"job {job_id} to be done", 30, every=0.05)
        assert client.post("/users", json={}).status_code == 422  # bad input: no job, no user
        assert client.get("/jobs/999999").status_code == 404
        client.post("/users", json={"name": "bob"})
        dashboard = client.get("/aioq/jobs?queue=email")
        assert dashboard.status_code == 200
        assert "read-only" in dashboard.text


def run_example(name: str, dsn: str) -> subprocess.CompletedProcess[str]:
    """Run examples/NAME on the given database, as ``AIOQ_DSN=... python examples/NAME``."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        env={**os.environ, "AIOQ_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


@pytest.mark.timeout(120)
def test_quickstart_runs_on_the_given_database(dsn: str) -> None:
    result = run_example("quickstart.py", dsn)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "receipts sent for orders [1, 2]; jobs left in the queue: 0" in result.stdout
    assert "order 3 rows = 0, its jobs = 0" in result.stdout


@pytest.mark.timeout(120)
def test_interrupting_the_demo_leaves_no_server_behind() -> None:
    # The embedded server's temp dir goes under a TMPDIR of our own, so we can see it vanish;
    # it must be traversable by the unprivileged user the server runs as under root.
    tmp = Path(tempfile.mkdtemp(prefix="aioq-demo-"))
    tmp.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "AIOQ_DSN"}
    env["TMPDIR"] = str(tmp)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = None
        for line in proc.stdout:  # bounded by the test timeout
            if "running at postgresql://" in line:
                port = int(line.rsplit(":", 1)[1].split("/")[0])
                break
        assert port is not None
        assert any(tmp.iterdir())  # the server's data dir exists while it runs
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        assert list(tmp.iterdir()) == []
        with (
            pytest.raises(ConnectionRefusedError),
            socket.create_connection(("127.0.0.1", port), timeout=2),
        ):
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.anyio
async def test_flask_app_defers_in_its_request_transaction(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples import flask_app

    monkeypatch.setenv("AIOQ_DSN", dsn)  # the task's own connection, in the worker
    client = flask_app.app_from_env().test_client()
    assert client.post("/signup?fail=1", json={"email": "a@example.com"}).status_code == 500
    assert client.post("/signup", json={"email": "nope"}).status_code == 422
    created = client.post("/signup", json={"email": "a@example.com"})
    assert created.status_code == 201
    job_id = created.json["job_id"]  # type: ignore[index]
    assert client.get(f"/jobs/{job_id}").json == {"status": "pending", "result": None}
    await aioq.Worker(dsn=dsn, registry=flask_app.registry, poll_interval=0.2).run_until_idle()
    assert client.get(f"/jobs/{job_id}").json == {
        "status": "succeeded",
        "result": '"welcomed user 2"',
    }
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT id, welcomed FROM signups")
    finally:
        await conn.close()
    assert [tuple(r) for r in rows] == [(2, True)]  # the rolled-back signup took id 1


@pytest.mark.timeout(120)
def test_workflow_example_runs_on_the_given_database(dsn: str) -> None:
    result = run_example("workflow.py", dsn)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "deferred run 1: 13 steps" in lines
    assert lines.count("load: 10 parts for 2026-12-01, total 5050") == 1
    assert lines.index("notify: report for 2026-12-01 ready") > lines.index(
        "load: 10 parts for 2026-12-01, total 5050"
    )
    assert "run 1 nightly-report: succeeded, 13 steps succeeded" in lines


@pytest.mark.timeout(120)
def test_typed_values_example_runs_on_the_given_database(dsn: str) -> None:
    result = run_example("typed_values.py", dsn)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == (
        'stored: {"invoice": {"currency": "EUR", "due": "2026-12-31", "lines": [{"price": "9.95",'
        ' "qty": 2, "sku": "book"}, {"price": "1.10", "qty": 1, "sku": "pen"}], "order":'
        ' "7d3c8e1a-5b2f-4c6d-9e8f-0a1b2c3d4e5f"}}'
    )
    assert (
        "refused: cannot defer 'typed_values.send_invoice': argument 'invoice.lines[0].price'"
        " must be Decimal, got int 3"
    ) in lines
    assert "invoice for 7d3c8e1a-5b2f-4c6d-9e8f-0a1b2c3d4e5f: 21.00 EUR, due 2026-12-31" in lines
    assert "invoice for 00000000-0000-0000-0000-000000000002: 21.00 EUR, due 2026-12-31" in lines
    assert "result: Sent(total=Decimal('21.00'))" in lines
    assert (
        "bad job: dead: PayloadError: cannot call 'typed_values.send_invoice' with its stored"
        " arguments: argument 'invoice.due' must be date (ISO 8601 text), got str 'end of year'"
    ) in lines
