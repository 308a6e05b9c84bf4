"""A Django project as aioq's commands see it: ``aioq ... --django SETTINGS``.

``setup`` configures Django (``django.setup()``), imports each installed app's ``tasks``
module (as Django's admin discovers ``admin`` modules), and reads from the settings what every
command needs: the DSN of the jobs' database (``DATABASES[OPTIONS["DATABASE"]]``), aioq's
schema and the queues of the ``TASKS`` backends that are aioq's. The worker's registry
(:class:`DjangoTasks`) finds each Django task by the module path its jobs carry, among the
modules the project imported: it never imports one because a job names it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import aioq
from aioq.errors import ConfigError

__all__ = ("DjangoTasks", "Project", "dsn_of", "setup")

logger = logging.getLogger(__name__)

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
    """A worker's registry: a registry's own tasks, and the Django tasks its jobs name by module
    path.

    A job's task name is found here first; else among the tasks the project declared: the
    Django task (run through the runner of the worker's aioq backend: its options, result TTL,
    timeout) or aioq task of that name at that module path, in a module this process has
    already imported (each installed app's ``tasks`` module and what it imports, the worker's
    MODULE). Nothing is imported because a job names it: an import runs a module's code, which a
    job must not choose. Any other name is not found (None: the worker's rule for a task it does
    not know applies, as in a deploy where a newer worker knows it), and the first job of each
    says why in the log.
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
        self._told: set[str] = set()  # the names whose absence the log has explained

    def get(self, name: str) -> aioq.Task[..., Any] | None:
        """Return the task of this name: registered, or declared at that module path; None if
        there is none (the worker's rule for a task it does not know then applies: the job waits
        for a worker that knows it, docs/architecture.md "Unknown tasks"). Never raises,
        whatever the name."""
        found = super().get(name)
        if found is not None:
            return found
        try:
            resolved, why = self._resolve(name)
            if resolved is not None:
                return self.add(resolved)
        except Exception as exc:  # a declared object that breaks on inspection
            why = f"{type(exc).__name__}: {exc}"
        self._tell(name, why)
        return None

    def _resolve(self, path: str) -> tuple[aioq.Task[..., Any] | None, str]:
        """The task a job's path names among the declared ones, or None and why not."""
        from aioq.contrib.django.backend import declared
        from aioq.contrib.django.tasks import Task

        found, why = declared(path)
        if why is not None:
            return None, why
        if isinstance(found, aioq.Task) and found.name == path:
            return found, ""
        if isinstance(found, Task) and found.module_path == path:
            return self.backend.runner(found), ""
        if isinstance(found, Task):
            return None, f"{path!r} names the Django task {found.module_path!r}"
        kind = type(found).__name__
        return None, f"{path!r} is a {kind}, not a Django task (decorate it with @task)"

    def _tell(self, name: str, why: str) -> None:
        """Log why a task name is not found, once per name (a bounded memory of names)."""
        if name in self._told:
            return
        if len(self._told) >= MAX_TOLD:
            self._told.clear()
        self._told.add(name)
        logger.warning("no Django task %r in this worker: %s", name[:200], why[:500])


MAX_TOLD = 1000  # names whose absence a worker remembers having logged


def served(project: Project, registry: aioq.Registry, given: Sequence[str] | None) -> list[str]:
    """The queues a worker serves: those given, else the registry's and the backends'."""
    if given:
        return list(given)
    return sorted({*registry.queues(), *project.queues})
