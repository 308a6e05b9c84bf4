"""CPU seconds of a process tree (psutil) and of one database's PostgreSQL backends (/proc).

PostgreSQL's share is the user+sys time of the backends connected to the measured database
(pid from pg_stat_activity, times from psutil, i.e. /proc/<pid>/stat), excluding our own
watching connection: the delta between start() and stop() for backends alive at both, plus the
whole time of backends that appeared in between. Background processes (WAL writer,
checkpointer, autovacuum) are not counted. None when the server is not on this host.
"""

from __future__ import annotations

import asyncpg
import psutil

BACKENDS = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
"""


def tree_cpu(pid: int) -> float:
    """User+sys seconds of a process and its live descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def host_busy() -> float:
    """CPU seconds the whole host has spent busy (all processes, all cores: not idle, not iowait)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _cpu(pid: int) -> float | None:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


class PgCpu:
    """CPU used by the backends of one database between start() and stop()."""

    def __init__(self, conn: asyncpg.Connection, local: bool) -> None:
        self.conn = conn
        self.local = local
        self.before: dict[int, float] = {}

    @classmethod
    async def connect(cls, dsn: str) -> PgCpu:
        conn = await asyncpg.connect(dsn)
        own = await conn.fetchval("SELECT pg_backend_pid()")
        # The server runs here if our own backend's pid is a postgres process on this host.
        try:
            local = "postgres" in psutil.Process(own).name()
        except psutil.Error:
            local = False
        return cls(conn, local)

    async def _sample(self) -> dict[int, float]:
        pids = [r[0] for r in await self.conn.fetch(BACKENDS)]
        out = {}
        for pid in pids:
            cpu = _cpu(pid)
            if cpu is not None:
                out[pid] = cpu
        return out

    async def start(self) -> None:
        if self.local:
            self.before = await self._sample()

    async def stop(self) -> float | None:
        if not self.local:
            return None
        after = await self._sample()
        return sum(cpu - self.before.get(pid, 0.0) for pid, cpu in after.items())

    async def close(self) -> None:
        await self.conn.close()
