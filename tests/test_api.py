"""The public surface: explicit, sorted, importable, documented."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import subprocess
import sys

import pytest

import aioq
from aioq.worker import WorkerOptions


def test_all_is_a_sorted_tuple_of_real_names() -> None:
    assert isinstance(aioq.__all__, tuple)
    assert list(aioq.__all__) == sorted(aioq.__all__)
    assert len(set(aioq.__all__)) == len(aioq.__all__)
    for name in aioq.__all__:
        assert hasattr(aioq, name), name


# What an application author writes: tasks and their schedules, workflows, the worker, the
# running job's context, results, the schema's install, and the errors application code raises
# (Retry, Fail) or catches around a defer (ArgumentError) and a result (JobFailed, JobCancelled,
# ResultMissing, ResultTimeout). Operations are aioq.admin's; every error class is aioq.errors'.
TOP_LEVEL = (
    "AioqError",
    "ArgumentError",
    "Backoff",
    "Fail",
    "JobCancelled",
    "JobContext",
    "JobFailed",
    "Registry",
    "ResultMissing",
    "ResultTimeout",
    "Retry",
    "StepFailed",
    "Task",
    "Worker",
    "WorkerConfig",
    "Workflow",
    "__version__",
    "chain",
    "current_job",
    "group",
    "install",
    "periodic",
    "result",
    "result_sync",
    "task",
    "workflow",
    "workflow_sync",
)


def test_the_top_level_is_what_an_application_writes() -> None:
    assert aioq.__all__ == TOP_LEVEL
    assert not set(aioq.__all__) & set(aioq.MOVED)


def test_admin_and_errors_all_are_tuples_of_real_names() -> None:
    # Sorted as ruff's RUF022 sorts (constants first), which `make lint` checks.
    for module in (aioq.admin, aioq.errors):
        assert isinstance(module.__all__, tuple)
        assert len(set(module.__all__)) == len(module.__all__), module
        for name in module.__all__:
            assert hasattr(module, name), name


def test_every_public_callable_has_a_docstring() -> None:
    for module in (aioq, aioq.admin, aioq.errors):
        for name in module.__all__:
            value = getattr(module, name)
            if callable(value):
                assert (value.__doc__ or "").strip(), name


def test_every_error_derives_from_the_root_and_lives_in_aioq_errors() -> None:
    errors = [getattr(aioq.errors, n) for n in aioq.errors.__all__]
    for error in errors:
        assert issubclass(error, aioq.AioqError), error
        assert error.__module__ == "aioq.errors", error
        # The module's docstring draws the tree: every class is in it.
        assert re.search(rf"\b{error.__name__}\b", aioq.errors.__doc__ or ""), error
    top = [getattr(aioq, n) for n in aioq.__all__ if isinstance(getattr(aioq, n), type)]
    raised = {e for e in top if issubclass(e, BaseException)}
    assert raised <= set(errors)
    # Every exception class the core defines is one of them (a subpackage's own, such as the
    # testing plugin's DrainError, stays with it).
    subpackages = ("aioq.cli", "aioq.web", "aioq.testing", "aioq.contrib", "aioq.dev")
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if name.startswith("aioq") and not name.startswith(subpackages):
            for value in vars(module).values():
                if (
                    isinstance(value, type)
                    and issubclass(value, BaseException)
                    and value.__module__ == name
                    and not value.__name__.startswith("_")
                ):
                    assert value in errors, f"{value.__module__}.{value.__qualname__}"


@pytest.mark.parametrize("name", sorted(aioq.MOVED))
def test_a_name_that_left_the_top_level_warns_and_names_its_new_place(name: str) -> None:
    new = aioq.MOVED[name]
    module, _, attribute = new.rpartition(".")
    with pytest.warns(DeprecationWarning, match=rf"aioq\.{name} moved: use {re.escape(new)} "):
        found = getattr(aioq, name)
    assert found is getattr(importlib.import_module(module), attribute)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        aioq.nothing_here  # type: ignore[attr-defined]  # noqa: B018


def test_the_worker_s_keyword_options_are_the_config_s_fields() -> None:
    # Worker(**options: Unpack[WorkerOptions]) lets mypy --strict catch a misspelt option
    # (tests/typing/bad_defer.py); the TypedDict and the config must name the same options
    # with the same types (queues: also one name, or any sequence of names).
    config = {f.name: f.type for f in dataclasses.fields(aioq.WorkerConfig)}
    options = {k: v.__forward_arg__ for k, v in WorkerOptions.__annotations__.items()}
    assert options.pop("queues") == "str | Sequence[str] | None"
    assert config.pop("queues") == "tuple[str, ...] | None"
    assert options == config
    assert WorkerOptions.__total__ is False
    options_parameter = inspect.signature(aioq.Worker).parameters["options"]
    assert options_parameter.annotation == "Unpack[WorkerOptions]"


def test_importing_aioq_pulls_in_no_optional_dependency() -> None:
    code = (
        "import sys, aioq\n"
        "loaded = [m for m in ('prometheus_client', 'fastapi', 'starlette', 'httpx', 'httpx2',"
        " 'jinja2', 'uvicorn', 'sqlalchemy', 'opentelemetry', 'psycopg', 'pytest', 'aioq.contrib',"
        " 'aioq.testing', 'aioq.web', 'aioq.cli') if m in sys.modules]\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_cli_imports_the_dashboard_only_for_aioq_web() -> None:
    code = (
        "import sys, aioq.cli\n"
        "loaded = [m for m in ('starlette', 'jinja2', 'uvicorn', 'aioq.web') if m in sys.modules]\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
