"""Every statement as it is sent, checked in under tests/sql/ (docs/architecture.md, "Statements").

    make sql-golden          # (or: python tests/golden.py) rewrite tests/sql/ from the code

A change to a template, a fragment or a statement's parameters shows in the diff of these
files as the final SQL; tests/test_sql.py fails while they differ from the code.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import sys
from pathlib import Path
from typing import Any

import aioq.sql
from aioq.sql import DEFAULT_SCHEMA, Named, Statement

GOLDEN = Path(__file__).parent / "sql"
COMMAND = "make sql-golden"


def all_statements() -> dict[str, Statement[Any] | Named[Any, Any]]:
    """Every statement of aioq/sql/ and of the dashboard (aioq/web/sql.py), by name."""
    modules = [f"aioq.sql.{info.name}" for info in pkgutil.iter_modules(aioq.sql.__path__)]
    found: dict[str, Statement[Any] | Named[Any, Any]] = {}
    for module_name in [*modules, "aioq.web.sql"]:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if isinstance(value, Statement | Named):
                found[f"{module_name.removeprefix('aioq.')}.{name}"] = value
    return found


def golden_text(name: str, statement: Statement[Any] | Named[Any, Any]) -> str:
    """The checked-in form of a statement: what it is, its parameters by number, its text."""
    inner = statement.statement if isinstance(statement, Named) else statement
    params = ", ".join(f"${i} :{p}" for i, p in enumerate(inner.params, 1)) or "none"
    head = f"-- aioq.{name}, rendered for the schema {DEFAULT_SCHEMA!r} ({COMMAND} writes it)\n"
    if isinstance(statement, Named):
        params += f" (the fields of aioq.{name.rpartition('.')[0]}.{statement.params.__name__})"
    return f"{head}-- parameters: {params}\n{statement.text(DEFAULT_SCHEMA).strip()}\n"


def expected() -> dict[str, str]:
    """The golden files the code makes, by file name."""
    return {f"{name}.sql": golden_text(name, s) for name, s in all_statements().items()}


def problems(have: dict[str, str]) -> str | None:
    """What differs between the checked-in files (by name) and the code, as unified diffs and
    the command that rewrites them; None when nothing does."""
    want = expected()
    found = []
    for name in sorted(set(want) | set(have)):
        if name not in have:
            found.append(f"tests/sql/{name} is missing")
        elif name not in want:
            found.append(f"tests/sql/{name} is no statement's any more")
        elif have[name] != want[name]:
            diff = difflib.unified_diff(
                have[name].splitlines(),
                want[name].splitlines(),
                f"tests/sql/{name} (checked in)",
                f"{name} (as the code renders it)",
                lineterm="",
            )
            found.append("\n".join(diff))
    if not found:
        return None
    return (
        "the statements differ from their golden files; if the change is meant, run"
        f" `{COMMAND}` and commit tests/sql/:\n\n" + "\n\n".join(found)
    )


def checked_in() -> dict[str, str]:
    """The golden files as checked in, by name."""
    return {p.name: p.read_text() for p in GOLDEN.glob("*.sql")}


def main() -> None:
    """Rewrite tests/sql/ from the code (files of statements that are gone are removed)."""
    GOLDEN.mkdir(exist_ok=True)
    want = expected()
    for stale in sorted(set(p.name for p in GOLDEN.glob("*.sql")) - set(want)):
        (GOLDEN / stale).unlink()
        print(f"removed tests/sql/{stale}")
    changed = 0
    for name, text in sorted(want.items()):
        path = GOLDEN / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed += 1
            print(f"wrote tests/sql/{name}")
    print(f"{len(want)} statements, {changed} files written", file=sys.stderr)


if __name__ == "__main__":
    main()
