"""aioq in a Django project: the Tasks backend, ``defer_sync(connection, ...)``, the worker.

- ``TASKS = {"default": {"BACKEND": "aioq.contrib.django.AioqBackend", ...}}``: Django's
  ``@task`` functions enqueue aioq jobs in the caller's transaction (:mod:`.backend`).
- ``"aioq.contrib.django"`` in ``INSTALLED_APPS`` adds ``manage.py aioq ...``: every ``aioq``
  command, set up with the project's settings (its database, schema and queues).
- ``task.defer_sync(django.db.connection, ...)``: native aioq tasks from a view (:mod:`.db`).

Importing this package imports no Django module until ``AioqBackend`` is asked for, so the
connection adapter (:mod:`.db`) loads without the Tasks framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aioq.contrib.django.backend import AioqBackend

__all__ = ("AioqBackend",)


def __getattr__(name: str) -> Any:
    if name == "AioqBackend":
        from aioq.contrib.django.backend import AioqBackend

        return AioqBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
