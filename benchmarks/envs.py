"""Interpreters for peers that cannot run in the benchmark's own venv.

Oban for Python needs Python >= 3.12; the benchmark venv runs whatever ``make bench`` was given
(3.11 or newer). Its cells run in a venv of their own, benchmarks/.venv-oban, built here from
the first Python >= 3.12 found (``$AIOQ_BENCH_PYTHON312``, ``python3.15`` .. ``python3.12`` on
PATH, then pyenv's and /usr's installs) and rebuilt when its requirements file or pyproject.toml
changes; aioq is installed in it too (``-e``: the harness's modules import it). Celery
gets one too (benchmarks/.venv-celery, from the benchmark's own Python): its Redis client
version conflicts with arq's.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the repository: aioq goes into every venv (the harness imports it)
# Per system: (venv directory, requirements file, the oldest Python it runs on). Celery's needs
# redis-py >= 6.4 where arq needs < 6: it cannot share the benchmark venv either.
VENVS = {
    "oban": (".venv-oban", "requirements-oban.txt", (3, 12)),
    "celery": (".venv-celery", "requirements-celery.txt", (3, 11)),
}


def _version(exe: str) -> tuple[int, int] | None:
    """The interpreter's (major, minor), None if it does not run (a pyenv shim with no version)."""
    try:
        out = subprocess.run(
            [exe, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    major, minor = out.stdout.split()
    return int(major), int(minor)


def candidates() -> list[str]:
    """Interpreters to try, in order (duplicates and missing ones are skipped by the caller)."""
    # The interpreter that runs the benchmark first (its base, not its venv), for the peers
    # that only need a venv of their own.
    named = [getattr(sys, "_base_executable", ""), os.environ.get("AIOQ_BENCH_PYTHON312", "")]
    named += [shutil.which(f"python3.{m}") or "" for m in range(15, 11, -1)]
    roots = [os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv")]
    for root in filter(None, roots):
        found = glob.glob(os.path.join(root, "versions", "3.*", "bin", "python3"))
        named += sorted(found, key=_sort_key, reverse=True)
    named += sorted(glob.glob("/usr/bin/python3.1[2-9]"), key=_sort_key, reverse=True)
    named += sorted(glob.glob("/usr/local/bin/python3.1[2-9]"), key=_sort_key, reverse=True)
    return list(dict.fromkeys(n for n in named if n))


def _sort_key(path: str) -> tuple[int, ...]:
    digits = [p for p in path.replace("/", ".").split(".") if p.isdigit()]
    return tuple(int(d) for d in digits)


def find_python(oldest: tuple[int, int]) -> str | None:
    """The first interpreter of at least ``oldest`` that runs."""
    for exe in candidates():
        found = _version(exe)
        if found is not None and found >= oldest:
            return exe
    return None


def python_for(name: str) -> tuple[str | None, str]:
    """(the interpreter that runs ``name``'s cells, why not): its venv, built when needed."""
    if name not in VENVS:
        return sys.executable, ""
    where, requirements, oldest = VENVS[name]
    venv = os.path.join(HERE, where)
    exe = os.path.join(venv, "bin", "python")
    req = os.path.join(HERE, requirements)
    digest = hashlib.sha256()
    for path in (req, os.path.join(ROOT, "pyproject.toml")):  # as the Makefile's bench venv
        with open(path, "rb") as f:
            digest.update(f.read())
    stamp = digest.hexdigest()
    stamp_file = os.path.join(venv, ".installed")
    if os.path.exists(stamp_file) and os.path.exists(exe):
        with open(stamp_file) as f:
            if f.read().strip() == stamp:
                return exe, ""
    base = find_python(oldest)
    if base is None:
        want = ".".join(map(str, oldest))
        return None, (
            f"needs Python >= {want}: none found (set AIOQ_BENCH_PYTHON312 to one, or install"
            f" python{want})"
        )
    print(f"building {where} for {name} with {base}", flush=True)
    steps = [
        [base, "-m", "venv", "--clear", venv],
        [exe, "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [exe, "-m", "pip", "install", "--quiet", "-r", req, "-e", ROOT],
    ]
    for step in steps:
        out = subprocess.run(step, capture_output=True, text=True)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"building its venv failed ({' '.join(step[:4])}): {last[:200]}"
    with open(stamp_file, "w") as f:
        f.write(stamp)
    return exe, ""
