"""What a newcomer's first commands meet, through the real console script: a directory where
a module was meant, a module that registers no task, and no database at all."""

from __future__ import annotations

from pathlib import Path

from procs import aioq_cli, assert_one_line_error

TASKS = "import aioq\n\n\n@aioq.task\nasync def ping() -> None:\n    pass\n"


def test_a_directory_without_init_is_named_not_run_as_an_empty_registry(
    dsn: str, tmp_path: Path
) -> None:
    # ./app/app.py, and `aioq worker app` typed in ./ : Python imports the directory ./app as
    # an empty namespace package, which the worker used to run with no task at all.
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "app.py").write_text(TASKS)
    for target in ("app", "app:registry"):
        assert_one_line_error(
            aioq_cli(dsn, "worker", target, cwd=tmp_path),
            f"'app' imported the directory {tmp_path / 'app'} (it has no __init__.py)",
            "run aioq from the directory that holds app.py",
        )
    assert_one_line_error(
        aioq_cli(dsn, "defer", "app:registry", "app.ping", cwd=tmp_path), "no __init__.py"
    )


def test_a_module_without_tasks_is_warned_about(dsn: str, tmp_path: Path) -> None:
    # The schema "nothere" does not exist: the worker stops at its check, after the warning.
    (tmp_path / "empty.py").write_text("x = 1\n")
    (tmp_path / "tasks.py").write_text(TASKS)
    empty = aioq_cli(dsn, "worker", "empty", "--schema", "nothere", cwd=tmp_path)
    assert empty.returncode == 2, empty
    [warning, error] = empty.stderr.strip().splitlines()
    assert "WARNING aioq.cli" in warning
    assert (
        "empty registers no tasks: every job this worker claims waits for a worker that knows"
        " its task, then is dead with UnknownTaskError" in warning
    )
    assert "is not installed in this database" in error
    assert_one_line_error(
        aioq_cli(dsn, "worker", "tasks", "--schema", "nothere", cwd=tmp_path),
        "is not installed in this database",
    )


def test_no_database_points_at_aioq_dev(tmp_path: Path) -> None:
    assert_one_line_error(
        aioq_cli(None, "worker", "tasks", cwd=tmp_path),
        "no database: pass --dsn or set AIOQ_DSN (aioq dev starts a throwaway PostgreSQL",
    )


def test_every_command_s_help_explains_the_global_options_it_takes(tmp_path: Path) -> None:
    for command in (["worker"], ["jobs", "list"], ["schema", "status"], ["queues", "pause"]):
        shown = aioq_cli(None, *command, "--help", cwd=tmp_path)
        assert shown.returncode == 0, shown
        assert "as above" not in shown.stdout  # nothing is above: this help is all one sees
        assert "--debug               log at DEBUG and show tracebacks of errors" in shown.stdout
        assert "set up this Django project" in shown.stdout
