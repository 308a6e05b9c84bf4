"""Tasks defined in a script: the script (``python shop.py``, ``python -m pkg.jobs``) and a worker
that imports the same file (``aioq worker shop``) give each task one name (docs/tasks.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from db import fetch
from procs import spawner
from waits import wait_for

SCRIPT = textwrap.dedent(
    """
    import asyncio
    import sys

    import asyncpg

    import aioq

    registry = aioq.Registry()
    done = []


    @registry.task
    async def greet(who: str) -> None:
        done.append(who)


    async def main() -> None:
        conn = await asyncpg.connect(sys.argv[1])
        try:
            print(greet.name, await greet.defer(conn, who="script"))
        finally:
            await conn.close()


    if __name__ == "__main__":
        asyncio.run(main())
    """
)


def python(*args: str, cwd: Path) -> str:
    """Run this Python with ARGS in ``cwd``; return its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran
    return ran.stdout


def test_a_task_deferred_by_its_script_runs_on_a_worker_of_that_module(
    dsn: str, tmp_path: Path
) -> None:
    (tmp_path / "shop.py").write_text(SCRIPT)
    name, job_id = python("shop.py", dsn, cwd=tmp_path).split()
    assert name == "shop.greet"  # not __main__.greet
    assert fetch(dsn, "SELECT task FROM aioq.jobs WHERE id = $1", int(job_id))[0][0] == name
    with spawner(dsn) as spawn:
        worker = spawn("worker", "shop:registry", "--poll-interval", "0.2", cwd=tmp_path)
        wait_for(lambda: not fetch(dsn, "SELECT 1 FROM aioq.jobs"), "the job to run")
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr
    assert "UnknownTaskError" not in stderr
    assert f"job {job_id} shop.greet succeeded" in stderr, stderr


def test_a_script_in_a_package_is_named_as_the_worker_imports_it(tmp_path: Path) -> None:
    package = tmp_path / "app"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "jobs.py").write_text(SCRIPT.replace("asyncio.run(main())", "print(greet.name)"))
    imported = python("-c", "import app.jobs; print(app.jobs.greet.name)", cwd=tmp_path)
    assert imported == "app.jobs.greet\n"
    assert python("app/jobs.py", cwd=tmp_path) == imported  # a file in a package
    assert python("-m", "app.jobs", cwd=tmp_path) == imported  # run as a module
    assert python("jobs.py", cwd=package) == imported  # from inside the package
