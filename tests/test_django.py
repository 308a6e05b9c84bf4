"""aioq in a real Django project (tests/django_project) on PostgreSQL.

The project's tasks enqueue through Django's Tasks framework (Django 6's ``django.tasks``, or
the ``django-tasks`` backport on Django 5.2) onto the aioq backend, and native aioq tasks defer
on Django's connection. Workers are real ``aioq worker --django`` processes. The test process
runs Django too: each test points the project's connection at a database of its own.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

django = pytest.importorskip(
    "django", reason="Django is not installed (pip install aioq-pg[django])"
)

import asyncpg  # noqa: E402
import orjson  # noqa: E402
from db import run_sql, with_database  # noqa: E402
from procs import AIOQ, aioq_cli, kill_tree  # noqa: E402
from waits import wait_for  # noqa: E402

import aioq  # noqa: E402

PROJECT = Path(__file__).parent / "django_project"
SETTINGS = "djproject.settings"
JOBS_SCHEMA = "jobq"


@pytest.fixture(scope="session")
def django_template(admin_dsn: str, template_db: str) -> Iterator[dict[str, str]]:
    """Django set up in this process on a template database with the project migrated, and a
    second database ("jobs", aioq's schema ``jobq``) for the project's second backend."""
    pid = os.getpid()
    name, jobs = f"aioq_django_template_{pid}", f"aioq_django_jobs_{pid}"
    run_sql(
        admin_dsn,
        f'DROP DATABASE IF EXISTS "{name}"',
        f'DROP DATABASE IF EXISTS "{jobs}"',
        f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"',
        f'CREATE DATABASE "{jobs}"',
    )

    async def install_jobq() -> None:
        conn = await asyncpg.connect(with_database(admin_dsn, jobs))
        try:
            await aioq.install(conn, schema=JOBS_SCHEMA)
        finally:
            await conn.close()

    asyncio.run(install_jobq())
    env = {
        "AIOQ_TEST_DJANGO_DSN": with_database(admin_dsn, name),
        "AIOQ_TEST_DJANGO_JOBS_DSN": with_database(admin_dsn, jobs),
        "DJANGO_SETTINGS_MODULE": SETTINGS,
    }
    os.environ.update(env)
    sys.path.insert(0, str(PROJECT))
    django.setup()
    from django.core.management import call_command
    from django.db import connections

    call_command("migrate", verbosity=0)
    connections.close_all()  # a template takes no connections while it is copied
    yield env
    connections.close_all()
    run_sql(
        admin_dsn,
        f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
        f'DROP DATABASE IF EXISTS "{jobs}" WITH (FORCE)',
    )


@pytest.fixture
def project(admin_dsn: str, django_template: dict[str, str]) -> Iterator[dict[str, str]]:
    """The project on a database of this test's own (migrated, aioq installed); yields the
    environment of its worker processes."""
    from django.db import connections

    name = f"aioq_django_{os.urandom(6).hex()}"
    template = django_template["AIOQ_TEST_DJANGO_DSN"].rsplit("/", 1)[1]
    run_sql(admin_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    connections["default"].close()
    connections["default"].settings_dict["NAME"] = name
    env = {**django_template, "AIOQ_TEST_DJANGO_DSN": with_database(admin_dsn, name)}
    yield env
    connections.close_all()
    connections["default"].settings_dict["NAME"] = template
    run_sql(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def sql(dsn: str, query: str, *params: object) -> list[tuple[Any, ...]]:
    """Run a statement on a connection of its own (outside Django), committed."""

    async def fetch() -> list[tuple[Any, ...]]:
        conn = await asyncpg.connect(dsn)
        try:
            return [tuple(r) for r in await conn.fetch(query, *params)]
        finally:
            await conn.close()

    return asyncio.run(fetch())


@contextmanager
def worker(env: dict[str, str], log: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """An ``aioq worker --django`` process (the console script) of the project; stopped with
    SIGTERM at the end, and its exit status checked."""
    clean = {k: v for k, v in os.environ.items() if k != "AIOQ_DSN"}  # the DSN is Django's
    with log.open("w") as out:
        proc = subprocess.Popen(
            [AIOQ, "worker", "--django", SETTINGS, "--poll-interval", "0.2", *args],
            cwd=PROJECT,
            env={**clean, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            yield proc
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        finally:
            kill_tree(proc)


@contextmanager
def rolled_back(using: str | None = None) -> Iterator[None]:
    """An atomic block (a savepoint when nested) that is rolled back at its end."""
    from django.db import transaction

    with transaction.atomic(using=using):
        yield
        transaction.set_rollback(True, using=using)


def log_tail(log: Path) -> Callable[[], str]:
    return lambda: log.read_text()


def tasks() -> Any:
    """The project's tasks module (imported once Django is set up)."""
    import shop.tasks

    return shop.tasks


# --- the backend: enqueue inside Django's transaction ----------------------------------------


def test_the_backend_says_what_it_supports(project: dict[str, str]) -> None:
    from aioq.contrib.django import AioqBackend
    from aioq.contrib.django.tasks import InvalidTask, task_backends

    backend = task_backends["default"]
    assert isinstance(backend, AioqBackend)
    assert (backend.supports_defer, backend.supports_async_task) == (True, True)
    assert (backend.supports_get_result, backend.supports_priority) == (True, True)
    with pytest.raises(InvalidTask, match="nowhere"):
        tasks().add.using(queue_name="nowhere")
    with pytest.raises(InvalidTask, match="priority"):
        tasks().add.using(priority=101)


def test_unknown_options_are_a_configuration_error() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from aioq.contrib.django import AioqBackend

    with pytest.raises(ImproperlyConfigured, match="RETRIES"):
        AioqBackend("x", {"OPTIONS": {"RETRIES": 3}})
    with pytest.raises(ImproperlyConfigured, match="lease"):
        AioqBackend("x", {"OPTIONS": {"LEASE": 0.1}})


def test_enqueue_joins_the_atomic_block_rolled_back_or_committed(
    project: dict[str, str],
) -> None:
    from django.db import transaction

    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    add = tasks().add
    with rolled_back():
        gone = add.enqueue(1, 2)
        assert sql(dsn, "SELECT count(*) FROM aioq.jobs") == [(0,)]  # not committed yet
    with transaction.atomic():
        kept = add.enqueue(3, b=4)
        with rolled_back():  # a savepoint
            add.enqueue(5, 6)
    rows = sql(dsn, "SELECT id, task, queue, priority, max_attempts, args::text FROM aioq.jobs")
    assert [r[:5] for r in rows] == [(int(kept.id), "shop.tasks.add", "default", 0, 1)]
    assert orjson.loads(rows[0][5]) == {"args": [3], "kwargs": {"b": 4}, "backend": "default"}
    assert (kept.status, kept.backend, kept.args) == ("READY", "default", [3])
    with pytest.raises(Exception, match="no job"):
        add.get_result(gone.id)


def test_enqueue_maps_queue_priority_and_run_after(project: dict[str, str]) -> None:
    from django.db import connection
    from django.utils import timezone

    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    when = timezone.now() + timedelta(hours=1)
    later = tasks().add.using(run_after=when, priority=-20).enqueue(1, 1)
    urgent = tasks().record.enqueue("x")  # @task(queue_name="emails", priority=10)
    rows = dict(
        (r[0], r[1:]) for r in sql(dsn, "SELECT id, queue, priority, run_at FROM aioq.jobs")
    )
    assert rows[int(later.id)] == ("default", -20, when)
    assert rows[int(urgent.id)][:2] == ("emails", 10)
    assert not connection.in_atomic_block  # autocommit: each enqueue committed at once
    result = tasks().add.get_result(later.id)
    assert (result.status, result.is_finished, result.attempts) == ("READY", False, 0)
    assert result.enqueued_at is not None
    assert result.args == [1, 1]


def test_bad_arguments_are_refused_before_anything_is_written(project: dict[str, str]) -> None:
    from django.db import transaction

    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    with transaction.atomic():
        with pytest.raises(TypeError):
            tasks().add.enqueue(object(), 1)
        with pytest.raises(aioq.errors.SerializationError, match="nan"):
            tasks().add.enqueue(float("nan"), 1)
        tasks().add.enqueue((1, 2), 3)  # Django's JSON: a tuple is a list
    [(args,)] = sql(dsn, "SELECT args::text FROM aioq.jobs")
    assert orjson.loads(args) == {"args": [[1, 2], 3], "kwargs": {}, "backend": "default"}


def test_enums_and_choices_are_taken_as_djangos_json_takes_them(project: dict[str, str]) -> None:
    import uuid

    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    t = tasks()
    # What Django's serialisation takes (django-tasks-db stores them): their values, as JSON.
    result = t.describe.enqueue(t.Size.LARGE, t.Color.BLUE, level=t.Level.HIGH, keys={1: "a"})
    [(args,)] = sql(dsn, "SELECT args::text FROM aioq.jobs WHERE id = $1", int(result.id))
    assert orjson.loads(args) == {
        "args": [2, "blue"],
        "kwargs": {"level": 2, "keys": {"1": "a"}},
        "backend": "default",
    }
    assert (result.args, result.kwargs) == ([2, "blue"], {"level": 2, "keys": {"1": "a"}})
    assert [type(v) for v in result.args] == [int, str]
    # What it refuses, named: the task and the argument (a TypeError, as Django's own).
    for args, kwargs, name in [((uuid.uuid4(), 1), {}, "args[0]"), ((1,), {"b": object()}, "b")]:
        with pytest.raises(aioq.ArgumentError) as info:
            t.add.enqueue(*args, **kwargs)
        assert isinstance(info.value, TypeError)
        message = str(info.value)
        assert message.startswith("cannot defer 'shop.tasks.add': argument"), message
        assert f"argument {name!r} cannot be a Django task's argument" in message
        assert "Unsupported type" in message
        assert info.value.argument == name
    assert sql(dsn, "SELECT count(*) FROM aioq.jobs") == [(1,)]


def test_typed_values_reach_a_django_task_as_json_and_a_native_task_as_instances(
    project: dict[str, str], tmp_path: Path
) -> None:
    import uuid
    from datetime import date, datetime

    from django.db import connection, transaction
    from django.utils import timezone

    t = tasks()
    described = t.describe.enqueue(size=t.Size.SMALL, color=t.Color.RED)
    when = timezone.now()
    reminder = t.Reminder(uuid.uuid4(), date(2026, 12, 31), t.Size.LARGE)
    with transaction.atomic():
        t.remind.defer_sync(connection, reminder=reminder, at=when)
        with pytest.raises(aioq.ArgumentError, match=r"argument 'reminder\.due' must be date"):
            t.remind.defer_sync(connection, reminder=t.Reminder(uuid.uuid4(), "x", 1), at=when)
    log = tmp_path / "worker.log"
    with worker(project, log):
        wait_for(
            lambda: (
                t.describe.get_result(described.id).is_finished
                and t.Log.objects.filter(label__startswith="Reminder").exists()
            ),
            "both jobs to end",
            on_timeout=log_tail(log),
        )
    assert t.describe.get_result(described.id).return_value == {
        "size": [1, "int"],
        "color": ["red", "str"],
        "level": [None, "NoneType"],
    }
    [label] = t.Log.objects.values_list("label", flat=True)
    assert label == "Reminder UUID date Size datetime"
    assert isinstance(when, datetime)


def test_get_result_of_an_unknown_or_foreign_job(project: dict[str, str]) -> None:
    from django.db import connection

    from aioq.contrib.django.tasks import TaskResultDoesNotExist, task_backends

    backend = task_backends["default"]
    for result_id in ("nope", "123456"):
        with pytest.raises(TaskResultDoesNotExist):
            backend.get_result(result_id)
    native = tasks().notify.defer_sync(connection, order_id=1)
    with pytest.raises(TaskResultDoesNotExist, match="not a Django task"):
        backend.get_result(str(native))


def test_aenqueue_and_aget_result(project: dict[str, str]) -> None:
    async def main() -> Any:
        result = await tasks().add.aenqueue(2, 2)
        return await tasks().add.aget_result(result.id)

    assert asyncio.run(main()).status == "READY"


# --- native aioq tasks on Django's connection ------------------------------------------------


def test_defer_sync_on_djangos_connection_follows_its_transactions(
    project: dict[str, str],
) -> None:
    from django.db import connection, transaction

    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    notify = tasks().notify
    with rolled_back():
        notify.defer_sync(connection, order_id=1)
    with transaction.atomic():
        kept = notify.defer_sync(connection, order_id=2)
        with rolled_back():
            notify.defer_many_sync(connection, [{"order_id": 3}, {"order_id": 4}])
        keyed = notify.options(unique_key="k").defer_sync(connection, order_id=5)
        assert notify.options(unique_key="k").defer_sync(connection, order_id=6) == keyed
        with pytest.raises(aioq.ArgumentError):
            notify.defer_sync(connection, order=7)  # type: ignore[call-arg]
        assert sql(dsn, "SELECT count(*) FROM aioq.jobs") == [(0,)]
    assert sql(dsn, "SELECT id FROM aioq.jobs ORDER BY id") == [(kept,), (keyed,)]
    assert aioq.admin.get_job_sync(connection, kept).queue == "emails"  # type: ignore[union-attr]
    assert aioq.admin.cancel_jobs_sync(connection, [kept]) == {kept: "cancelled"}


def test_a_database_that_is_not_postgresql_is_refused(project: dict[str, str]) -> None:
    from django.db import connection

    class Elsewhere:
        vendor = "sqlite"
        alias = "legacy"

        __module__ = connection.__class__.__module__

    with pytest.raises(aioq.errors.ConfigError, match="legacy"):
        tasks().notify.defer_sync(Elsewhere(), order_id=1)  # type: ignore[arg-type]


def test_views_enqueue_in_their_transaction(project: dict[str, str], tmp_path: Path) -> None:
    from django.test import Client

    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    client = Client(raise_request_exception=False)
    assert client.post("/orders/1/pay?fail=1").status_code == 500
    assert client.post("/orders/2/notify?fail=1").status_code == 500
    assert sql(dsn, "SELECT count(*) FROM aioq.jobs") == [(0,)]
    assert sql(dsn, "SELECT count(*) FROM shop_order") == [(0,)]
    result_id = client.post("/orders/3/pay").json()["result_id"]
    job_id = client.post("/orders/4/notify").json()["job_id"]
    with worker(project, tmp_path / "worker.log") as proc:
        wait_for(
            lambda: (
                sql(dsn, "SELECT count(*) FROM shop_order WHERE paid OR notified = 1") == [(2,)]
            ),
            "the worker to run the view's jobs",
            on_timeout=log_tail(tmp_path / "worker.log"),
        )
        assert proc.poll() is None
    assert tasks().charge.get_result(result_id).return_value == {"order": 3, "paid": True}
    assert sql(dsn, "SELECT id FROM aioq.jobs") == []
    assert job_id


# --- the worker ------------------------------------------------------------------------------


def test_a_django_worker_runs_every_kind_of_task_and_reports_through_get_result(
    project: dict[str, str], tmp_path: Path
) -> None:
    from django.db import connection

    from aioq.contrib.django.tasks import TaskResultStatus

    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    t = tasks()
    t.Order.objects.create(id=1, customer="ann")
    t.Order.objects.create(id=2, customer="ann")
    results = {
        "add": t.add.enqueue(2, b=3),
        "charge": t.charge.enqueue(1, card="ok"),
        "declined": t.charge.enqueue(2, card="declined"),
        "context": t.whoami.enqueue(note="hi"),
        "async": t.count_orders.enqueue("ann"),
        "emails": t.record.using(priority=50).enqueue("urgent"),
    }
    # Jobs a Django worker must refuse, clearly: not Django tasks, or not importable.
    foreign = aioq.Registry()
    native = t.notify.options(queue="default").defer_sync(connection, order_id=1)
    for foreign_task in (
        foreign.task(name="shop.tasks.not_a_task")(lambda: None),
        foreign.task(name="shop.missing.task")(lambda: None),
    ):
        foreign_task.defer_sync(connection)
    log = tmp_path / "worker.log"
    # No worker that knows shop.missing.task will come: dead at once, not left waiting.
    with worker(project, log, "--unknown-task-grace", "0"):
        wait_for(
            lambda: (
                all(r.task.get_result(r.id).is_finished for r in results.values())
                and sql(dsn, "SELECT count(*) FROM aioq.jobs WHERE status = 'dead'") == [(3,)]
            ),
            "every job to end",
            on_timeout=log_tail(log),
        )
    got = {name: r.task.get_result(r.id) for name, r in results.items()}
    assert got["add"].status == TaskResultStatus.SUCCESSFUL
    assert got["add"].return_value == 5
    assert (got["add"].attempts, got["add"].errors) == (1, [])
    assert got["add"].started_at <= got["add"].finished_at
    assert got["charge"].return_value == {"order": 1, "paid": True}
    assert t.Order.objects.get(id=1).paid  # the task's ORM write, in the worker
    declined = got["declined"]
    assert declined.status == TaskResultStatus.FAILED
    assert not t.Order.objects.get(id=2).paid
    [error] = declined.errors
    assert error.exception_class_path == "shop.tasks.PaymentDeclined"
    assert error.exception_class is t.PaymentDeclined
    assert "card declined for order 2" in error.traceback
    with pytest.raises(ValueError, match="failed"):
        declined.return_value  # noqa: B018
    assert got["context"].return_value == {
        "id": results["context"].id,
        "attempt": 1,
        "note": "hi",
    }
    assert got["async"].return_value == 2
    assert got["emails"].return_value is None
    dead = dict(sql(dsn, "SELECT task, last_error FROM aioq.jobs WHERE status = 'dead'"))
    for unknown in ("shop.tasks.not_a_task", "shop.missing.task"):  # not tasks it knows
        assert dead[unknown].startswith(f"UnknownTaskError: no task named {unknown!r}")
    assert "'shop.tasks.not_a_task' is a function, not a Django task" in log.read_text()
    assert set(dead) == {"shop.tasks.not_a_task", "shop.missing.task", "shop.tasks.charge"}
    # The native aioq task (autodiscovered in shop.tasks) ran in the same worker.
    assert t.Order.objects.get(id=1).notified == 1
    assert sql(dsn, "SELECT id FROM aioq.jobs WHERE id = $1", native) == []


POISON = (
    ".x.y",  # import_string raised TypeError: the worker stopped
    ".",  # ValueError, likewise
    "os.system",  # importable, callable, no task
    "shop.tasks.not_a_task",  # a function of a task module, not a task
    "shop.boom.cleanup",  # its module calls sys.exit on import
    "shop.missing.task",
    "no_dots",
    "shop.tasks." + "x" * 5000,
)


def test_a_job_naming_no_declared_task_never_stops_the_worker_nor_imports(
    project: dict[str, str], tmp_path: Path
) -> None:
    """Rows whose task is no Django task the project declared: malformed paths, a module the
    project never imported (one that would sys.exit on import), os.system, a plain function.
    The worker imports nothing a row names, fails each as a task it does not know, says why in
    its log, and goes on running real tasks."""
    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    marker = tmp_path / "boom-imported"
    insert = (
        "INSERT INTO aioq.jobs (queue, task, max_attempts) VALUES ('default', $1, 1) RETURNING id"
    )
    poison = {task: sql(dsn, insert, task)[0][0] for task in POISON}
    after = tasks().add.enqueue(20, b=22)  # claimed after every poisoned row
    log = tmp_path / "worker.log"
    env = {**project, "AIOQ_TEST_BOOM_MARKER": str(marker)}
    # No worker will ever know these: dead at once rather than waiting for one.
    with worker(env, log, "--concurrency", "2", "--unknown-task-grace", "0") as proc:
        wait_for(
            lambda: (
                after.task.get_result(after.id).is_finished
                and sql(dsn, "SELECT count(*) FROM aioq.jobs WHERE status = 'dead'")
                == [(len(POISON),)]
            ),
            "every job to end",
            on_timeout=log_tail(log),
        )
        assert proc.poll() is None, log.read_text()
    assert after.task.get_result(after.id).return_value == 42
    assert not marker.exists(), "a job made the worker import shop.boom"
    dead = dict(sql(dsn, "SELECT id, last_error FROM aioq.jobs WHERE status = 'dead'"))
    for task, job_id in poison.items():
        said = f"UnknownTaskError: no task named {task!r}"[:300]  # the long one's is cut
        assert dead[job_id].startswith(said), task[:40]
    text = log.read_text()
    assert "no Django task '.x.y' in this worker: '.x.y' is not a module path" in text
    assert (
        "no Django task 'shop.boom.cleanup' in this worker: module 'shop.boom' is not loaded"
        in text
    )
    assert "'os.system' is a builtin_function_or_method, not a Django task" in text
    assert "Traceback" not in text


def test_a_django_task_this_worker_cannot_find_waits_unspent_then_is_dead_after_the_grace(
    project: dict[str, str], tmp_path: Path
) -> None:
    """A deploy in progress: the web tier enqueues a task of a module the worker does not have
    yet. Its job waits for a worker that knows it, attempts unspent, visible as such; the
    worker goes on with the tasks it knows; past the grace, the job is dead, saying why."""
    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    insert = "INSERT INTO aioq.jobs (queue, task) VALUES ('default', $1) RETURNING id"
    [(waiting,)] = sql(dsn, insert, "shop.newer.task")
    log = tmp_path / "worker.log"
    with worker(project, log):
        marked = (
            "SELECT status, attempts, claims FROM aioq.jobs"
            " WHERE id = $1 AND unknown_since IS NOT NULL"
        )
        wait_for(lambda: sql(dsn, marked, waiting), "the job marked", on_timeout=log_tail(log))
        after = tasks().add.enqueue(1, b=2)
        wait_for(lambda: after.task.get_result(after.id).is_finished, "a later job")
        # Still waiting, its attempt refunded, claimed once (this worker skips it since).
        assert sql(dsn, marked, waiting) == [("pending", 0, 1)]
        listed = aioq_cli(
            project["AIOQ_TEST_DJANGO_DSN"], "jobs", "list", "--status", "pending"
        ).stdout
        assert "pending (waits for a worker that knows its task since" in listed
        # An hour later (its grace), the worker makes it dead.
        sql(dsn, "UPDATE aioq.jobs SET unknown_since = now() - interval '2 hours'")
        wait_for(
            lambda: sql(dsn, "SELECT status FROM aioq.jobs WHERE id = $1", waiting) == [("dead",)],
            "the job dead",
            on_timeout=log_tail(log),
        )
    [(error,)] = sql(dsn, "SELECT last_error FROM aioq.jobs WHERE id = $1", waiting)
    assert error.startswith("UnknownTaskError: no task named 'shop.newer.task' is registered")
    assert "unknown_task_grace (3600s" in error


def test_priority_decides_the_order_on_one_queue(project: dict[str, str], tmp_path: Path) -> None:
    t = tasks()
    for label, priority in (("low", -5), ("normal", 0), ("high", 50), ("normal-2", 0)):
        t.record.using(priority=priority).enqueue(label)
    log = tmp_path / "worker.log"
    with worker(project, log, "--concurrency", "1", "--prefetch", "0"):
        wait_for(lambda: t.Log.objects.count() == 4, "four runs", on_timeout=log_tail(log))
    assert list(t.Log.objects.order_by("id").values_list("label", flat=True)) == [
        "high",
        "normal",
        "normal-2",
        "low",
    ]


def test_another_database_through_the_backend_of_that_alias(
    project: dict[str, str], tmp_path: Path
) -> None:
    from django.db import transaction

    jobs_dsn = project["AIOQ_TEST_DJANGO_JOBS_DSN"]
    report = tasks().add.using(backend="jobs", queue_name="reports")
    with rolled_back(using="jobs"):
        report.enqueue(1, 1)
    with transaction.atomic(using="jobs"):
        kept = report.enqueue(20, 22)
    assert sql(jobs_dsn, "SELECT id, queue FROM jobq.jobs") == [(int(kept.id), "reports")]
    assert sql(project["AIOQ_TEST_DJANGO_DSN"], "SELECT count(*) FROM aioq.jobs") == [(0,)]
    log = tmp_path / "worker.log"
    with worker(project, log, "--tasks-backend", "jobs"):
        wait_for(
            lambda: report.get_result(kept.id).is_finished, "the report", on_timeout=log_tail(log)
        )
    assert report.get_result(kept.id).return_value == 42


def test_two_thousand_jobs_through_two_processes_leave_no_connection_behind(
    project: dict[str, str], tmp_path: Path
) -> None:
    from django.db import connection, transaction

    dsn = project["AIOQ_TEST_DJANGO_DSN"]
    t = tasks()
    t.Order.objects.create(id=1, customer="load")
    with transaction.atomic():
        for _ in range(1000):
            t.touch.enqueue(1)
            t.atouch.enqueue(1)
    connection.close()
    django_backends = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'djangotest'"
    )
    peak = 0

    def done() -> bool:
        nonlocal peak
        peak = max(peak, sql(dsn, django_backends)[0][0])
        return sql(dsn, "SELECT notified FROM shop_order WHERE id = 1") == [(2000,)]

    log = tmp_path / "worker.log"
    with worker(project, log, "--processes", "2", "--concurrency", "8"):
        wait_for(done, "2 000 jobs", timeout=240, on_timeout=log_tail(log))
        wait_for(
            lambda: sql(dsn, "SELECT count(*) FROM aioq.results") == [(2000,)],
            "their results",
            on_timeout=log_tail(log),
        )
        # Idle now: every Django connection a job opened was closed after it.
        left = sql(dsn, django_backends)[0][0]
    assert left == 0
    # At most one per running job: 8 threads or async runs per process.
    assert 0 < peak <= 2 * 8, peak
    assert sql(dsn, "SELECT count(*) FROM aioq.jobs") == [(0,)]
    print(f"\n2 000 Django jobs, 2 processes: peak {peak} Django connections, {left} left after")


def test_manage_py_runs_aioq_commands_with_the_projects_settings(
    project: dict[str, str],
) -> None:
    tasks().add.enqueue(1, 2)
    env = {**{k: v for k, v in os.environ.items() if k != "AIOQ_DSN"}, **project}
    run = subprocess.run(
        [sys.executable, "manage.py", "aioq", "jobs", "list", "--json"],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    [job] = orjson.loads(run.stdout)
    assert (job["task"], job["queue"]) == ("shop.tasks.add", "default")
    status = subprocess.run(
        [sys.executable, "manage.py", "aioq", "schema", "status", "--tasks-backend", "jobs"],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0, status.stderr
    assert JOBS_SCHEMA in status.stdout


def test_the_dashboard_mounted_beside_django_in_one_asgi_app(project: dict[str, str]) -> None:
    testclient = pytest.importorskip("starlette.testclient", reason="needs aioq-pg[web]")
    from django.core.asgi import get_asgi_application
    from starlette.applications import Starlette
    from starlette.routing import Mount

    import aioq.web

    # docs/django.md's recipe: asgi.py routes /aioq/ to the dashboard, the rest to Django.
    dashboard = aioq.web.app(dsn=project["AIOQ_TEST_DJANGO_DSN"])

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await dashboard.state.aioq_database.close()  # a mounted app gets no lifespan of its own

    application = Starlette(
        routes=[Mount("/aioq", app=dashboard), Mount("/", app=get_asgi_application())],
        lifespan=lifespan,
    )
    with testclient.TestClient(application) as client:
        paid = client.post("/orders/7/pay")
        assert paid.status_code == 200, paid.text
        page = client.get("/aioq/jobs?queue=default")
        assert page.status_code == 200
        assert "shop.tasks.charge" in page.text
        assert 'href="/aioq/' in page.text  # its links stay under the mount


def test_a_django_migration_installs_aioqs_schema(admin_dsn: str) -> None:
    """docs/django.md's migration (tests/django_project/jobschema) on a database without aioq:
    `manage.py migrate` installs the schema at the version it pins, recorded, and `migrate
    jobschema zero` removes it."""
    from aioq.migrate import latest_version

    migration = PROJECT / "jobschema" / "migrations" / "0001_aioq_schema.py"
    pinned = int(re.findall(r"to_version=(\d+)", migration.read_text())[0])
    name = f"aioq_django_schema_{os.urandom(6).hex()}"
    run_sql(admin_dsn, f'CREATE DATABASE "{name}"')
    dsn = with_database(admin_dsn, name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIOQ_", "DJANGO_"))}
    env.update(AIOQ_TEST_DJANGO_DSN=dsn, AIOQ_TEST_DJANGO_SCHEMA_APP="1")

    def manage(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=PROJECT, env=env,
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip

    try:
        migrated = manage("migrate", "jobschema")
        assert migrated.returncode == 0, migrated.stderr
        status = subprocess.run(
            [AIOQ, "schema", "status", "--json", "--dsn", dsn],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        state = orjson.loads(status.stdout)
        assert (state["installed"], state["latest"]) == (pinned, latest_version())
        assert state["pending"] == list(range(pinned + 1, latest_version() + 1))
        undone = manage("migrate", "jobschema", "zero")
        assert undone.returncode == 0, undone.stderr
        assert sql(dsn, "SELECT to_regnamespace('aioq') IS NULL") == [(True,)]
    finally:
        run_sql(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
