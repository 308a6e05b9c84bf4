"""The public surface: explicit, sorted, importable, documented."""

from __future__ import annotations

import subprocess
import sys

import aioq


def test_all_is_a_sorted_tuple_of_real_names() -> None:
    assert isinstance(aioq.__all__, tuple)
    assert list(aioq.__all__) == sorted(aioq.__all__)
    assert len(set(aioq.__all__)) == len(aioq.__all__)
    for name in aioq.__all__:
        assert hasattr(aioq, name), name


def test_every_public_callable_has_a_docstring() -> None:
    for name in aioq.__all__:
        value = getattr(aioq, name)
        if callable(value):
            assert (value.__doc__ or "").strip(), name


def test_every_error_derives_from_the_root() -> None:
    errors = [getattr(aioq, n) for n in aioq.__all__ if n.endswith(("Error", "Control"))]
    errors += [aioq.Retry, aioq.Fail]
    for error in errors:
        assert issubclass(error, aioq.AioqError), error


def test_importing_aioq_pulls_in_no_optional_dependency() -> None:
    code = (
        "import sys, aioq\n"
        "loaded = [m for m in ('prometheus_client', 'fastapi', 'starlette', 'httpx', 'sqlalchemy',"
        " 'opentelemetry', 'psycopg', 'pytest', 'aioq.contrib', 'aioq.testing')"
        " if m in sys.modules]\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
