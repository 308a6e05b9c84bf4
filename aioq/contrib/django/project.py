"""A Django project as aioq's commands see it: ``aioq ... --django SETTINGS``.

``setup`` configures Django (``django.setup()``), imports each installed app's ``tasks``
module (as Django's admin discovers ``admin`` modules), and reads from the settings what every
command needs: the DSN of the jobs' database (``DATABASES[OPTIONS["DATABASE"]]``), aioq's
schema and the queues of the ``TASKS`` backends that are aioq's. The worker's registry
(:class:`DjangoTasks`) finds each Django task by the module path its jobs carry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import aioq
from aioq.errors import ConfigError
from aioq.options import JobOptions

__all__ = ("DjangoTasks", "Project", "dsn_of", "setup")

# What asyncpg takes from Django's OPTIONS (libpq's names); the rest stays Django's.
_DSN_OPTIONS = ("sslmode", "sslrootcert", "sslcert", "sslkey", "target_session_attrs")


def dsn_of(database: Mapping[str, Any]) -> str:
    """A PostgreSQL URL of a Django ``DATABASES`` entry."""
    engine = database.get("ENGINE", "")
    if "postgresql" not in engine:
        raise ConfigError("DATABASES", f"aioq's jobs live in PostgreSQL, not {engine or 'nothing'}")
    options = database.get("OPTIONS") or {}
    if "service" in options:
        raise ConfigError("DATABASES", "OPTIONS service is not supported: give HOST, NAME ...")
    user = quote(database.get("USER") or "", safe="")
    password = quote(str(database.get("PASSWORD") or ""), safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = database.get("HOST") or ""
    query = {k: str(options[k]) for k in _DSN_OPTIONS if k in options}
    if host.startswith("/"):  # a Unix socket's directory
        query["host"] = host
        host = ""
    port = f":{database['PORT']}" if database.get("PORT") else ""
    name = quote(database.get("NAME") or "", safe="")
    text = f"postgresql://{auth}{quote(host, safe='')}{port}/{name}"
    return f"{text}?{urlencode(query)}" if query else text


@dataclass(frozen=True, slots=True)
class Project:
    """What aioq's commands take from a Django project's settings."""

    dsn: str
    schema: str
    queues: tuple[str, ...]  # every queue of the aioq backends of that database and schema
    backend: str  # the TASKS alias whose options the worker runs Django tasks with

    def registry(self, base: aioq.Registry) -> DjangoTasks:
        """The worker's registry: ``base``'s tasks, and the Django tasks of their jobs."""
        return DjangoTasks(base, backend=self.backend)


def setup(settings_module: str, backend: str | None = None) -> Project:
    """Set Django up with these settings and read the project of its aioq ``TASKS`` backend.

    ``backend``: the TASKS alias whose database and schema the commands use (None: the only
    aioq backend, else "default").
    """
    import django
    from django.conf import settings
    from django.utils.module_loading import autodiscover_modules

    os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    django.setup()
    autodiscover_modules("tasks")  # the @task functions and aioq tasks of every app
    from aioq.contrib.django.backend import AioqBackend
    from aioq.contrib.django.tasks import task_backends

    ours = {
        alias: task_backends[alias]
        for alias in settings.TASKS
        if isinstance(task_backends[alias], AioqBackend)
    } if hasattr(settings, "TASKS") else {}  # fmt: skip
    if not ours:
        raise ConfigError(
            "TASKS", f"{settings_module} has no backend 'aioq.contrib.django.AioqBackend'"
        )
    if backend is None:
        backend = next(iter(ours)) if len(ours) == 1 else "default"
    chosen = ours.get(backend)
    if chosen is None:
        raise ConfigError(
            "TASKS", f"{backend!r} is not an aioq backend (aioq's: {', '.join(sorted(ours))})"
        )
    same = [b for b in ours.values() if (b.database, b.schema) == (chosen.database, chosen.schema)]
    queues = sorted({q for b in same for q in b.queues})
    return Project(
        dsn=dsn_of(settings.DATABASES[chosen.database]),
        schema=chosen.schema,
        queues=tuple(queues),
        backend=backend,
    )


class DjangoTasks(aioq.Registry):
    """A worker's registry: a registry's own tasks, and any task its jobs name by module path.

    A job's task name is found here first; else it is imported: a Django task runs through the
    runner of the worker's aioq backend (its options: result TTL, timeout), an aioq task under
    that name runs itself. Anything else fails the job at once (``aioq.Fail``) saying what the
    path is.
    """

    def __init__(self, base: aioq.Registry, *, backend: str) -> None:
        from aioq.contrib.django.backend import AioqBackend
        from aioq.contrib.django.tasks import task_backends

        chosen = task_backends[backend]
        assert isinstance(chosen, AioqBackend)
        self.backend: AioqBackend = chosen
        super().__init__(schema=self.backend.schema)
        for name in base:
            task = base.get(name)
            assert task is not None
            self.add(task)
        self.schedules = base.schedules

    def get(self, name: str) -> aioq.Task[..., Any] | None:
        """Return the task of this name, found by its module path if no registered one; None
        if this worker cannot import it (the worker's rule for a task it does not know then
        applies: the job waits for a worker that knows it, docs/architecture.md "Unknown
        tasks")."""
        found = super().get(name)
        if found is not None or "." not in name:
            return found
        resolved = self._resolve(name)
        if resolved is None:
            return None
        return self.add(resolved) if resolved.registry is not _REFUSED else resolved

    def _resolve(self, path: str) -> aioq.Task[..., Any] | None:
        from django.utils.module_loading import import_string

        from aioq.contrib.django.tasks import Task

        try:
            found: object = import_string(path)
        except ImportError:
            return None  # a task of a newer deploy, say: a worker that knows it may come
        if isinstance(found, aioq.Task) and found.name == path:
            return found
        if not isinstance(found, Task):
            kind = type(found).__name__
            return _refusal(
                path, f"{path!r} is a {kind}, not a Django task (decorate it with @task)"
            )
        return self.backend.runner(found)


_REFUSED = aioq.Registry()  # the registry of the tasks that refuse a job (never served)


def _refusal(path: str, why: str) -> aioq.Task[..., Any]:
    def refuse(**arguments: object) -> None:
        raise aioq.Fail(why)

    return aioq.Task(
        refuse,
        name=path,
        registry=_REFUSED,
        options=JobOptions(),
        timeout=None,
        retry=aioq.Backoff(),
    )


def served(project: Project, registry: aioq.Registry, given: Sequence[str] | None) -> list[str]:
    """The queues a worker serves: those given, else the registry's and the backends'."""
    if given:
        return list(given)
    return sorted({*registry.queues(), *project.queues})
