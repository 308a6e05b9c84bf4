"""Process helpers shared by the CLI tests and the chaos suite."""

from __future__ import annotations

from pathlib import Path

# The LISTEN connection of every worker process of this database; its worker id is host:pid:token.
LISTENERS = (
    "SELECT application_name FROM pg_stat_activity"
    " WHERE datname = current_database() AND application_name LIKE 'aioq listener %'"
)


def children(pid: int) -> set[int]:
    """The live pids whose parent is ``pid`` (a /proc scan)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.add(int(entry.name))
    return found


def pid_of(worker_id: str) -> int:
    """The pid in a worker id (``host:pid:token``), or in an aioq connection's application name."""
    return int(worker_id.split(":")[-2])
