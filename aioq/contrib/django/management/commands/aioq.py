"""``manage.py aioq ...``: the ``aioq`` command line, set up with this project's settings.

``manage.py aioq worker`` runs the worker of the project's Django tasks and aioq tasks,
``manage.py aioq schema apply`` installs aioq's schema in the jobs' database, and so on for
every ``aioq`` command (``manage.py aioq --help``). It is ``aioq --django SETTINGS ...``
with the settings manage.py uses.
"""

from __future__ import annotations

import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    """Run an aioq command with this project's settings."""

    help = "Run an aioq command (worker, schema apply, jobs, web, ...) for this project."

    def run_from_argv(self, argv: list[str]) -> None:
        """Hand everything after ``aioq`` to aioq's own parser."""
        from aioq.cli import main

        sys.exit(main(["--django", settings.SETTINGS_MODULE, *argv[2:]]))

    def handle(self, *args: Any, **options: Any) -> None:  # pragma: no cover - see above
        """Unused: ``run_from_argv`` hands the command line to aioq."""
