"""The package's shape: the import graph, and ``import aioq`` without any optional extra.

The graph is read from the source with :mod:`ast` (nothing is imported), counting every import:
at module level, inside functions and under ``TYPE_CHECKING`` alike, since each is a
dependency a reader must follow. Cycles are refused outright among the imports that run; a
cycle through an annotation-only import must be one of the known ones below.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import aioq

PACKAGE = Path(aioq.__file__).parent
SUBPACKAGES = ("cli", "dev", "web", "testing", "contrib")
OPTIONAL = (
    "asgiref",
    "django",
    "django_tasks",
    "fastapi",
    "prometheus_client",
    "psycopg",
    "psycopg2",
    "sqlalchemy",
    "opentelemetry",
    "starlette",
    "uvicorn",
)


def _module_name(path: Path) -> str:
    parts = ["aioq", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.AST) -> set[ast.AST]:
    """The nodes under ``if TYPE_CHECKING:``."""
    nodes: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                nodes.update(ast.walk(child))
    return nodes


def _imports(path: Path, module: str, *, typing: bool = True) -> set[str]:
    """The aioq modules (and packages) ``path`` imports, at any depth of its code (without
    the ``if TYPE_CHECKING:`` ones unless ``typing``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if typing else _type_only(tree)
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from aioq import cli` imports the module aioq.cli.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "aioq" or name.startswith("aioq.")}


def _graph(*, typing: bool = True) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        module: {
            name
            for name in _imports(path, module, typing=typing)
            if name in files and name != module
        }
        for module, path in files.items()
    }


def _is_core(module: str) -> bool:
    parts = module.split(".")
    return len(parts) < 2 or parts[1] not in SUBPACKAGES


def test_the_graph_sees_the_package() -> None:
    graph = _graph()
    assert {"aioq", "aioq.worker", "aioq.cli", "aioq.dev.server"} <= graph.keys()
    assert "aioq.worker.run" in graph["aioq.worker"]
    assert "aioq.sql.jobs" in graph["aioq.worker.claimer"]
    assert "aioq.dev.server" in graph["aioq.cli.worker"]


def test_the_core_never_imports_a_subpackage() -> None:
    graph = _graph()
    offenders = {
        f"{module} -> {target}"
        for module, targets in graph.items()
        if _is_core(module) and module != "aioq.__main__"  # the console entry point
        for target in targets
        if not _is_core(target)
    }
    assert not offenders, sorted(offenders)


def test_the_core_does_not_name_a_subpackage_module_either() -> None:
    # An import by name (importlib, a table of module paths) is an import the graph can't see.
    # Adapters reach the core through entry points (aioq.db.ADAPTERS), which name them.
    module_path = re.compile(rf"aioq\.(?:{'|'.join(SUBPACKAGES)})(?:\.\w+)*(?::\w+)?")
    offenders = {
        f"{_module_name(path)}: {node.value!r}"
        for path in PACKAGE.rglob("*.py")
        if _is_core(_module_name(path))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and module_path.fullmatch(node.value)
    }
    assert not offenders, sorted(offenders)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    # A package imports its __init__ first; `aioq.x -> aioq` is that, not a cycle of ours.
    edges = {m: {t for t in ts if not m.startswith(f"{t}.")} for m, ts in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph(typing=False))
    assert not cycles, [" -> ".join(cycle) for cycle in cycles]


def test_no_import_cycles_through_annotations_either() -> None:
    # An `if TYPE_CHECKING:` import is still a dependency a reader follows: the last one
    # (task <-> schedule, Registry.schedules annotated with Schedule) went when Schedule
    # stopped holding the Task and @aioq.periodic moved to aioq/periodic.py.
    cycles = _cycles(_graph(typing=True))
    assert not cycles, [" -> ".join(cycle) for cycle in cycles]


def _classes(path: Path) -> list[ast.ClassDef]:
    return [
        n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.ClassDef)
    ]


def test_every_service_of_a_worker_lives_under_aioq_worker() -> None:
    # What runs inside a worker is one `ls aioq/worker/`: every background loop is a Service
    # (aioq/worker/service.py), and each is defined there. The definitions users import (a
    # schedule, @aioq.periodic, the metrics) stay where they import them.
    services = {
        f"{_module_name(path)}.{node.name}"
        for path in PACKAGE.rglob("*.py")
        for node in _classes(path)
        if any(ast.unparse(base).startswith("Service") for base in node.bases)
    }
    assert len(services) >= 13, sorted(services)
    outside = sorted(s for s in services if not s.startswith("aioq.worker."))
    assert outside == []


def test_the_service_check_sees_a_service() -> None:
    source = "class Sampler(Service[int]):\n    pass\n\nclass Plain:\n    pass\n"
    tree = ast.parse(source)
    found = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.bases]
    assert found == ["Sampler"]


def test_no_top_level_name_hides_a_module_with_more_in_it() -> None:
    # `aioq.task` (the decorator) hid the module aioq/task.py, and `aioq.workflow` (the read of
    # a run) aioq/workflow.py: `aioq.task.MIN_LEASE` failed though the module had it. A module
    # may share its name with a top-level name only if that name is all it offers
    # (aioq/periodic.py).
    hidden = sorted(
        name
        for name in aioq.__all__
        if (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()
        if importlib.import_module(f"aioq.{name}").__all__ != (name,)
    )
    assert hidden == []


def test_the_doorbell_s_python_side_is_one_module() -> None:
    # Its statements are aioq/sql/doorbell.py; whatever runs them, or reads the advisory locks
    # they take, is aioq/doorbell.py (the listener service calls it).
    users = sorted(
        module
        for module, targets in _graph().items()
        if "aioq.sql.doorbell" in targets and not module.startswith("aioq.sql")
    )
    assert users == ["aioq.doorbell"]


def test_import_aioq_needs_no_optional_extra() -> None:
    # The extras are installed in the dev environment: hide them, as on a bare install.
    code = textwrap.dedent(
        f"""
        import importlib.abc, sys

        class NoExtras(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {OPTIONAL!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, NoExtras())
        import aioq, aioq.worker, aioq.admin, aioq.migrate, aioq.dbapi, aioq.doorbell
        print(sorted(m for m in sys.modules if m.split(".")[0] in {OPTIONAL!r}))
        print(aioq.__version__)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", aioq.__version__]


def test_import_aioq_loads_no_optional_module_even_when_installed() -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import aioq"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines()}
    assert "aioq" in imported
    assert not imported & set(OPTIONAL), sorted(imported & set(OPTIONAL))


def test_no_merge_conflict_markers_are_left_in_the_tree() -> None:
    # A merge once committed CHANGELOG.md with its <<<<<<< / >>>>>>> lines still in it.
    root = PACKAGE.parent
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.sql", "*.toml", "*.html", "*.cfg", "Makefile"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    if not files:  # not a git checkout (an sdist): nothing to check against
        files = [str(p.relative_to(root)) for p in root.rglob("*.md")]
    marker = re.compile(r"^(<{7}|>{7}) ", re.MULTILINE)
    left = [f for f in files if marker.search((root / f).read_text(errors="replace"))]
    assert left == []


# What a string of SQL starts with; prose in messages and docstrings does not match (upper case
# keywords followed by what only SQL puts after them).
_SQL = re.compile(
    r"\b(SELECT\s+(\*|[\w.(]+\s*(,|FROM|AS\b)|1\b|EXISTS)|INSERT\s+INTO|UPDATE\s+\S+\s+SET"
    r"|DELETE\s+FROM|WITH\s+\w+\s+AS\s*\(|CREATE\s+(TABLE|INDEX|SCHEMA|DATABASE|ROLE)"
    r"|DROP\s+(TABLE|SCHEMA|DATABASE|ROLE)|ALTER\s+TABLE|VACUUM\s*\()"
)
# The statement modules: the core's and the dashboard's.
STATEMENT_MODULES = ("aioq.sql", "aioq.web.sql")


def test_no_sql_text_outside_the_statement_modules() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module.startswith(STATEMENT_MODULES):
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and _SQL.search(node.value)
            ):
                offenders.append(f"{module}:{node.lineno}: {node.value[:60]!r}")
    assert offenders == []


def test_the_sql_check_sees_sql() -> None:
    for text in (
        "SELECT id FROM jobs",
        "SELECT 1",
        "WITH picked AS (",
        "UPDATE aioq.jobs SET x = 1",
        "DELETE FROM t",
        'DROP SCHEMA "x" CASCADE',
        "CREATE DATABASE x",
    ):
        assert _SQL.search(text), text
    for prose in ("Select the jobs to retry", "an INSERT ring", "DELETE the row", "SELECT them"):
        assert not _SQL.search(prose), prose


# A function longer than a screen and a half is several functions: split it where its steps are.
# A command's options are declared by a builder of its own, so the CLI's limit is a screen.
MAX_FUNCTION_LINES = 100
CLI_FUNCTION_LINES = 80


def _long_functions(source: str, name: str, limit: int) -> list[str]:
    return [
        f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source, name))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_is_longer_than_the_limit() -> None:
    long = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in _long_functions(
            path.read_text(),
            str(path.relative_to(PACKAGE)),
            CLI_FUNCTION_LINES if path.parent.name == "cli" else MAX_FUNCTION_LINES,
        )
    ]
    assert not long, long


def test_the_size_check_sees_a_long_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    source = f"def short():\n    pass\n\n\nasync def long():\n{body}"
    assert _long_functions(source, "m.py", 80) == ["m.py:5 long: 81 lines"]
    assert _long_functions(source, "m.py", 81) == []
