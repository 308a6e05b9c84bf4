"""The Django app of aioq: ``"aioq.contrib.django"`` in INSTALLED_APPS adds ``manage.py aioq``."""

from __future__ import annotations

from django.apps import AppConfig


class AioqConfig(AppConfig):
    """aioq's Django app (no models: aioq's tables are its own schema's, ``aioq schema apply``)."""

    name = "aioq.contrib.django"
    label = "aioq"
    verbose_name = "aioq"
