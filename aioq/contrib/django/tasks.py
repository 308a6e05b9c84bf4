"""Django's Tasks framework, wherever it comes from: ``django.tasks`` (Django 6) or the
``django-tasks`` backport (``django_tasks``, for Django 5.2).

Django 6's own module comes first. The names are the framework's (Any to mypy: Django ships
no annotations, and which framework is installed is known at run time only).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = (
    "FRAMEWORK",
    "BaseTaskBackend",
    "DjangoTask",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
)

_framework: Any
try:
    _framework = import_module("django.tasks")
except ImportError:  # Django 5.2: the backport
    _framework = import_module("django_tasks")
FRAMEWORK: str = _framework.__name__
"""``django.tasks`` or ``django_tasks``."""

_base: Any = import_module(f"{FRAMEWORK}.base")
_exceptions: Any = import_module(f"{FRAMEWORK}.exceptions")
_signals: Any = import_module(f"{FRAMEWORK}.signals")

BaseTaskBackend: Any = import_module(f"{FRAMEWORK}.backends.base").BaseTaskBackend
Task: Any = _framework.Task if hasattr(_framework, "Task") else _base.Task
TaskContext: Any = _base.TaskContext
TaskError: Any = _base.TaskError
TaskResult: Any = _base.TaskResult
TaskResultStatus: Any = _base.TaskResultStatus
task_backends: Any = _framework.task_backends
# The backport says InvalidTaskError where Django 6 says InvalidTask.
InvalidTask: Any = getattr(_exceptions, "InvalidTask", None) or _exceptions.InvalidTaskError
TaskResultDoesNotExist: Any = _exceptions.TaskResultDoesNotExist
task_enqueued: Any = _signals.task_enqueued
task_started: Any = _signals.task_started
task_finished: Any = _signals.task_finished
normalize_json: Any = (
    getattr(_base, "normalize_json", None) or import_module(f"{FRAMEWORK}.utils").normalize_json
)

DjangoTask = Any
"""A Django ``Task`` (an instance of :data:`Task`)."""
