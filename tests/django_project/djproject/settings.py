"""A Django project on aioq for the tests: its database comes from AIOQ_TEST_DJANGO_DSN.

AIOQ_TEST_DJANGO_JOBS_DSN, when set, adds a second database "jobs" and a TASKS backend
"jobs" whose jobs live there. AIOQ_TEST_DJANGO_SCHEMA_APP, when set, adds the app whose
migration installs aioq's schema (docs/django.md).
"""

import importlib.util
import os
from urllib.parse import unquote, urlsplit


def database(dsn: str) -> dict[str, object]:
    url = urlsplit(dsn)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": url.path.lstrip("/"),
        "USER": unquote(url.username or ""),
        "PASSWORD": unquote(url.password or ""),
        "HOST": url.hostname or "",
        "PORT": url.port or "",
        "OPTIONS": {"application_name": "djangotest"},
        "CONN_MAX_AGE": int(os.environ.get("AIOQ_TEST_DJANGO_CONN_MAX_AGE", "0")),
    }


SECRET_KEY = "not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
ROOT_URLCONF = "djproject.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["aioq.contrib.django", "shop"]
if importlib.util.find_spec("django.tasks") is None:  # Django 5.2: the backport
    INSTALLED_APPS.append("django_tasks")
if os.environ.get("AIOQ_TEST_DJANGO_SCHEMA_APP"):  # aioq's schema in a Django migration
    INSTALLED_APPS.append("jobschema")

DATABASES = {"default": database(os.environ["AIOQ_TEST_DJANGO_DSN"])}
TASKS = {
    "default": {
        "BACKEND": "aioq.contrib.django.AioqBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"RESULT_TTL": 3600},
    },
}
if os.environ.get("AIOQ_TEST_DJANGO_JOBS_DSN"):
    DATABASES["jobs"] = database(os.environ["AIOQ_TEST_DJANGO_JOBS_DSN"])
    TASKS["jobs"] = {
        "BACKEND": "aioq.contrib.django.AioqBackend",
        "QUEUES": ["reports"],
        "OPTIONS": {"DATABASE": "jobs", "SCHEMA": "jobq"},
    }
