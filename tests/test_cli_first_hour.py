"""Issue 11 through the real console script: the worker's queues, `aioq defer` with the
registry, finished jobs in `jobs show`, a closed stdout, and messages that point the right way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from db import fetch
from procs import AIOQ, aioq_cli, assert_one_line_error, spawner
from waits import wait_for

# The operations guide, whose Troubleshooting section quotes messages as printed.
TROUBLESHOOTING = " ".join(
    (Path(__file__).parent.parent / "docs" / "operations-and-cli.md").read_text().split()
)

TASKS = textwrap.dedent(
    """
    import aioq

    registry = aioq.Registry()


    @registry.task(name="email.welcome", queue="email", max_attempts=6, lease=45.0, priority=3)
    async def welcome(user_id: int, lang: str = "en") -> None:
        pass


    @registry.task(name="plain")
    async def plain() -> None:
        pass
    """
)


def job(dsn: str, job_id: int) -> asyncpg.Record | None:
    rows = fetch(dsn, "SELECT *, extract(epoch FROM lease) AS secs FROM aioq.jobs WHERE id = $1",
                 job_id)  # fmt: skip
    return rows[0] if rows else None


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "tasks.py").write_text(TASKS)
    return tmp_path


@pytest.fixture
def worker(dsn: str, app: Path) -> Iterator[Any]:
    """Start `aioq worker` in the app directory; stopped with SIGTERM, its stderr returned."""
    with spawner(dsn) as spawn:
        yield lambda *args: spawn(
            "worker", *args, "--poll-interval", "0.2", "--shutdown-grace", "5", cwd=app
        )


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, stderr
    return stderr


# 1 and 2 ------------------------------------------------------------------------------------


def test_defer_with_the_registry_uses_the_tasks_options_and_the_worker_serves_its_queue(
    dsn: str, app: Path, worker: Any
) -> None:
    done = aioq_cli(dsn, "defer", "tasks:registry", "email.welcome", "--args", '{"user_id": 1}',
                    cwd=app)  # fmt: skip
    assert done.returncode == 0, done
    assert done.stderr == ""
    first = int(done.stdout)
    row = job(dsn, first)
    assert row is not None
    assert (row["queue"], row["max_attempts"], row["secs"], row["priority"]) == ("email", 6, 45, 3)
    assert json.loads(row["args"]) == {"user_id": 1}

    # Flags override the task's options; MODULE alone finds `registry` in it.
    done = aioq_cli(dsn, "defer", "tasks", "email.welcome", "--args", '{"user_id": 2}',
                    "--queue", "urgent", "--max-attempts", "2", "--lease", "1m", "--priority",
                    "-1", "--unique-key", "welcome:2", "--json", cwd=app)  # fmt: skip
    assert done.returncode == 0, done
    second = json.loads(done.stdout)
    row = job(dsn, second["id"])
    assert row is not None
    assert second["queue"] == "urgent"
    assert (row["queue"], row["max_attempts"], row["secs"], row["priority"]) == (
        "urgent",
        2,
        60,
        -1,
    )
    assert row["unique_key"] == "welcome:2"
    again = aioq_cli(dsn, "defer", "tasks", "email.welcome", "--args", '{"user_id": 2}',
                     "--queue", "urgent", "--unique-key", "welcome:2", cwd=app)  # fmt: skip
    assert int(again.stdout) == second["id"]

    # With no --queue the worker serves 'default' and every queue its tasks name.
    proc = worker("tasks:registry")
    wait_for(lambda: job(dsn, first) is None, f"job {first} to be gone")
    stderr = stop(proc)
    assert "serving queues default,email with" in stderr
    assert "WARNING" not in stderr
    assert job(dsn, second["id"]) is not None  # 'urgent' is nobody's queue here


def test_a_worker_given_queues_names_the_tasks_it_leaves_out_in_one_line(
    dsn: str, app: Path, worker: Any
) -> None:
    proc = worker("tasks", "--queue", "default", "--queue", "other")
    wait_for(
        lambda: fetch(
            dsn,
            "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE 'aioq l%'"
            " AND datname = current_database()",
        ),
        "the worker's listener",
    )
    stderr = stop(proc)
    assert "WARNING" not in stderr, stderr
    [started] = [line for line in stderr.splitlines() if "serving queues" in line]
    assert "serving queues default,other with" in started
    assert started.endswith("tasks of other queues, left to other workers: email.welcome (email)")


def test_defer_refuses_an_unknown_task_and_bad_arguments_and_writes_nothing(
    dsn: str, app: Path
) -> None:
    def defer(*args: str) -> subprocess.CompletedProcess[str]:
        return aioq_cli(dsn, "defer", "tasks:registry", *args, cwd=app)

    assert_one_line_error(defer("email.welcom"), "no task named 'email.welcom' in tasks:registry",
                          "(registered: email.welcome, plain)")  # fmt: skip
    unexpected = assert_one_line_error(
        defer("email.welcome", "--args", '{"user": 1}'),
        "cannot defer 'email.welcome': unexpected argument 'user';"
        " missing required argument 'user_id' (the task takes (user_id, lang='en'))",
    )
    assert unexpected.removeprefix("aioq: error: ") in TROUBLESHOOTING
    assert_one_line_error(defer("email.welcome", "--args", '{"user_id": "1"}'),
                          "argument 'user_id' must be int, got str '1'")  # fmt: skip
    assert_one_line_error(defer("email.welcome", "--args", "[1]"), "must be a JSON object")
    assert_one_line_error(defer("plain", "--max-attempts", "0"), "must be >= 1")
    assert_one_line_error(aioq_cli(dsn, "defer", "tasks:nothere", "plain", cwd=app),
                          "module 'tasks' has no attribute 'nothere'")  # fmt: skip
    assert fetch(dsn, "SELECT count(*) FROM aioq.jobs")[0][0] == 0


def test_defer_without_a_registry_says_the_options_are_unknown(dsn: str, app: Path) -> None:
    done = aioq_cli(dsn, "defer", "email.welcome", "--args", '{"user_id": 1}', cwd=app)
    assert done.returncode == 0, done
    assert done.stderr.startswith(
        "aioq: note: no registry given, so the options of task 'email.welcome' are unknown:"
        " the job goes to queue 'default' with max_attempts 5"
    ), done.stderr
    assert len(done.stderr.splitlines()) == 1
    row = job(dsn, int(done.stdout))
    assert row is not None
    assert (row["queue"], row["max_attempts"]) == ("default", 5)

    done = aioq_cli(dsn, "defer", "email.welcome", "--queue", "email", "--max-attempts", "6")
    assert "the job goes to queue 'email' with max_attempts 6" in done.stderr
    row = job(dsn, int(done.stdout))
    assert row is not None
    assert (row["queue"], row["max_attempts"]) == ("email", 6)


# 3 ------------------------------------------------------------------------------------------


def test_jobs_show_finds_a_succeeded_job_or_says_why_it_cannot(
    dsn: str, app: Path, worker: Any
) -> None:
    first = int(aioq_cli(dsn, "defer", "tasks", "plain", cwd=app).stdout)
    proc = worker("tasks")
    wait_for(lambda: job(dsn, first) is None, f"job {first} to be gone")
    stop(proc)
    missing = aioq_cli(dsn, "jobs", "show", str(first))
    assert missing.returncode == 1
    assert missing.stderr == (
        f"aioq: job {first} not found: finished jobs are deleted unless workers keep them in"
        " the archive (aioq worker --keep-completed, Worker(keep_completed=True)) or keep a"
        " result (result_ttl); or it was pruned, or never existed\n"
    )
    assert missing.stderr.strip().replace(f"job {first}", "job 22") in TROUBLESHOOTING

    kept = int(aioq_cli(dsn, "defer", "tasks", "plain", cwd=app).stdout)
    proc = worker("tasks", "--keep-completed")
    wait_for(lambda: job(dsn, kept) is None, f"job {kept} to be gone")
    stop(proc)
    shown = aioq_cli(dsn, "jobs", "show", str(kept), "--json")
    assert shown.returncode == 0, shown
    values = json.loads(shown.stdout)
    assert values["status"] == "succeeded"
    assert values["task"] == "plain"
    assert values["locked_by"].split(":")[-2] == str(proc.pid)
    assert values["finished_at"] >= values["locked_at"] >= values["created_at"]
    table = aioq_cli(dsn, "jobs", "show", str(kept)).stdout
    assert [line.split() for line in table.splitlines() if line.startswith("status:")] == [
        ["status:", "succeeded"]
    ]
    listed = aioq_cli(dsn, "jobs", "list", "--status", "succeeded", "--json")
    assert [j["id"] for j in json.loads(listed.stdout)] == [kept]
    missing = aioq_cli(dsn, "jobs", "show", str(first))
    assert "not in the jobs table nor in the archive" in missing.stderr


# 4 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("jobs", [3, 2000])
def test_a_closed_stdout_ends_the_command_quietly(dsn: str, jobs: int) -> None:
    # 3 jobs fit in the pipe (the reader may or may not be gone when we write); 2000 do not.
    fetch(dsn, "INSERT INTO aioq.jobs (task, queue) SELECT 't', 'q' FROM generate_series(1, $1)",
          jobs)  # fmt: skip
    env = {**os.environ, "AIOQ_DSN": dsn}
    command = f"{AIOQ} jobs list --json --limit {jobs} | head -c 600"
    for _ in range(4):
        shell = subprocess.run(
            ["bash", "-c", command + "; s=${PIPESTATUS[0]}; echo; echo status=$s"],
            capture_output=True, text=True, env=env, timeout=30, check=False,
        )  # fmt: skip
        assert shell.stderr == ""
        assert shell.stdout.startswith("[\n  {\n")
        status = shell.stdout.rsplit("status=", 1)[1].strip()
        assert status in (("0", "141") if jobs == 3 else ("141",)), shell.stdout

        # The same through a pipe we close ourselves after reading a little.
        proc = subprocess.Popen([AIOQ, "jobs", "list", "--json", "--limit", str(jobs)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.read(100).startswith(b"[")
        proc.stdout.close()
        _, stderr = proc.communicate(timeout=30)
        assert stderr == b""
        assert proc.returncode in ((0, 141) if jobs == 3 else (141,))


# 5 ------------------------------------------------------------------------------------------


def test_messages_point_the_right_way(dsn: str, app: Path) -> None:
    assert_one_line_error(aioq_cli(dsn, "worker", "tasks:nothere", cwd=app),
                          "module 'tasks' has no attribute 'nothere'")  # fmt: skip
    (app / "notreg.py").write_text("registry = 1\n")
    assert_one_line_error(aioq_cli(dsn, "worker", "notreg:registry", cwd=app),
                          "notreg:registry is not an aioq.Registry (its type is int)")  # fmt: skip
    # An empty list is a successful answer (as ls and psql give): "(none)", exit 0.
    empty = aioq_cli(dsn, "jobs", "list", "--status", "dead")
    assert (empty.returncode, empty.stdout.splitlines()[-1]) == (0, "(none)")
    assert aioq_cli(dsn, "jobs", "list", "--json").stdout.strip() == "[]"
    # Troubleshooting quotes the first message of a database without the schema.
    no_schema = assert_one_line_error(aioq_cli(dsn, "jobs", "list", "--schema", "elsewhere"))
    assert no_schema.replace("elsewhere", "aioq") in TROUBLESHOOTING
    no_dsn = assert_one_line_error(aioq_cli(None, "jobs", "list"))
    assert no_dsn == (
        "aioq: error: no database: pass --dsn or set AIOQ_DSN"
        " (aioq dev starts a throwaway PostgreSQL and prints one)"
    )
