"""A Flask app on psycopg 3 that defers aioq jobs in its own transactions.

POST /signup writes a user and defers its welcome job on the same psycopg connection, in
ONE transaction: both commit or neither does (``?fail=1`` shows the rollback). GET /jobs/<id>
reads the job back with ``aioq.admin.get_job_sync``. The worker is a separate process::

    pip install 'aioq-pg[psycopg]' flask
    export AIOQ_DSN=postgresql://localhost/app
    aioq schema apply
    flask --app examples.flask_app:app_from_env run      # the web app
    aioq worker examples.flask_app                       # the worker (another terminal)
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from flask import Flask, abort, g, request

import aioq

registry = aioq.Registry()

SCHEMA = """
CREATE TABLE IF NOT EXISTS signups (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, email text NOT NULL UNIQUE,
    welcomed boolean NOT NULL DEFAULT false
)
"""


@registry.task(queue="email", result_ttl=3600)
def send_welcome(user_id: int) -> str:
    """Send the welcome (here: mark the user welcomed); runs in the worker process."""
    with psycopg.connect(os.environ["AIOQ_DSN"]) as conn:
        conn.execute("UPDATE signups SET welcomed = true WHERE id = %s", (user_id,))
    return f"welcomed user {user_id}"


def create_app(dsn: str) -> Flask:
    """The app: one psycopg connection per request, committed or rolled back at its end."""
    app = Flask(__name__)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)

    def db() -> psycopg.Connection[Any]:
        if "db" not in g:
            g.db = psycopg.connect(dsn)
        conn: psycopg.Connection[Any] = g.db
        return conn

    @app.teardown_request
    def finish(error: BaseException | None) -> None:
        conn: psycopg.Connection[Any] | None = g.pop("db", None)
        if conn is not None:
            if error is None:
                conn.commit()
            conn.close()  # closing without a commit rolls back

    @app.post("/signup")
    def signup() -> tuple[dict[str, object], int]:
        email = (request.get_json(silent=True) or {}).get("email")
        if not isinstance(email, str) or "@" not in email:
            abort(422)
        conn = db()
        row = conn.execute(
            "INSERT INTO signups (email) VALUES (%s) RETURNING id", (email,)
        ).fetchone()
        assert row is not None
        # The same connection, the same transaction: the job exists iff the user does.
        job_id = send_welcome.defer_sync(conn, user_id=row[0])
        if request.args.get("fail"):
            raise RuntimeError("the request failed after the defer: both are rolled back")
        return {"user_id": row[0], "job_id": job_id}, 201

    @app.get("/jobs/<int:job_id>")
    def job(job_id: int) -> dict[str, object]:
        found = aioq.admin.get_job_sync(db(), job_id)
        if found is None:
            abort(404)
        return {"status": found.status.value, "result": found.result}

    return app


def app_from_env() -> Flask:
    """``flask --app examples.flask_app:app_from_env run``: the database from AIOQ_DSN."""
    return create_app(os.environ["AIOQ_DSN"])
