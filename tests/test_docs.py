"""The documentation is checked like code: README.md and every guide under docs/.

Every fenced block names its language, and each language has its check:

- ``python``: parses (top-level ``await`` allowed); every ``aioq.*`` name it uses exists, and
  every keyword it passes to an aioq callable is one that callable takes. A block after
  ``<!-- quote: PATH -->`` must be a verbatim part of that file, which other tests run.
- ``sh``: each ``aioq ...`` command (of a pipeline too) parses with the real CLI's parser;
  ``psql`` runs its script in one transaction, stopping at an error; ``pip install`` names
  existing extras, ``make`` existing targets, ``python`` existing files; a command of any other
  program fails the test until it is given a check here.
- ``sql``: runs, in a transaction rolled back, on a database with aioq's schema.
- ``text``: shown output; the getting-started test compares it with what the commands print.
- ``mermaid``: a diagram drawn from the code: the job's states are aioq.states.mermaid().

The site is built with MkDocs in strict mode (broken links and anchors fail), and the README's
own links are checked, since MkDocs does not see it. Then the guides' examples run: the
README's example, the getting-started steps through the console script, the periodic jobs of
one's own registry, and the priority order the guides state.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import importlib
import inspect
import io
import itertools
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from procs import aioq_cli, spawner
from waits import wait_for

import aioq
from aioq.cli import _build_parser
from aioq.states import mermaid

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LANGUAGES = {"mermaid", "python", "sh", "sql", "text", "yaml"}
EXTRAS = set(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
)

FENCE = re.compile(r"^( *)```(\S*)\s*$")
MARKER = re.compile(r"^<!-- (quote: (?P<quote>\S+)|run) -->$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    quote: str | None  # the repository file the block quotes

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the quote marker just above each."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = len(opening.group(1)), opening.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        above = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(above)
        found.append(Block(page, i + 1, lang, body, marker and marker.group("quote")))
        i = end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]


def of(lang: str) -> list[Any]:
    return [pytest.param(b, id=str(b)) for b in BLOCKS if b.lang == lang]


def prose(page: Path) -> str:
    """A page's text without its code blocks, whitespace collapsed (as quoted messages are)."""
    text = re.sub(r"^ *```.*?^ *```$", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    return " ".join(text.split())


def test_every_page_has_blocks_and_every_block_names_a_checked_language() -> None:
    assert len(BLOCKS) >= 35
    assert {b.lang for b in BLOCKS} <= LANGUAGES, [
        str(b) for b in BLOCKS if b.lang not in LANGUAGES
    ]
    assert {b.page.name for b in BLOCKS if b.lang == "python"} >= {"README.md", "tasks.md"}


# --- python ------------------------------------------------------------------------------------


def resolve(path: list[str]) -> object:
    """The object ``aioq.a.b`` names, importing submodules on the way; AttributeError if none."""
    obj: object = aioq
    for i, name in enumerate(path[1:], start=1):
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        module = ".".join(path[: i + 1])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError:
            raise AttributeError(f"{'.'.join(path[:i])} has no {name!r}") from None
    return obj


def dotted(node: ast.expr) -> list[str] | None:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute) and (base := dotted(node.value)) is not None:
        return [*base, node.attr]
    return None


def accepts(obj: object, keyword: str) -> bool:
    try:
        params = inspect.signature(obj).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True  # no signature to check against
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return keyword in params


def python_problems(source: str) -> list[str]:
    """What is wrong with a snippet: unknown aioq names, keywords aioq callables do not take."""
    tree = ast.parse(source)
    compile(tree, "<doc>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    problems: list[str] = []
    local: dict[str, list[str]] = {"aioq": ["aioq"]}  # names bound to aioq objects
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "aioq":
            module = str(node.module).split(".")
            for alias in node.names:
                local[alias.asname or alias.name] = [*module, alias.name]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != "aioq":
                    continue
                # `import aioq.web` binds aioq; `import aioq.web as web` binds web to aioq.web.
                local[alias.asname or "aioq"] = parts if alias.asname else ["aioq"]
                try:
                    resolve(parts)
                except AttributeError as exc:
                    problems.append(f"import {alias.name}: {exc}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "aioq":
            for alias in node.names:
                try:
                    resolve(local[alias.asname or alias.name])
                except AttributeError as exc:
                    problems.append(f"from {node.module} import {alias.name}: {exc}")
        if not isinstance(node, ast.Attribute | ast.Call):
            continue
        target = node.func if isinstance(node, ast.Call) else node
        path = dotted(target)
        if path is None or path[0] not in local:
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "options"  # task.options(...), whatever the task
            ):
                problems += [
                    f".options({k.arg}=...): not an option of Task.options"
                    for k in node.keywords
                    if k.arg and not accepts(aioq.Task.options, k.arg)
                ]
            continue
        try:
            obj = resolve(local[path[0]] + path[1:])
        except AttributeError as exc:
            problems.append(f"{'.'.join(path)}: {exc}")
            continue
        if isinstance(node, ast.Call):
            problems += [
                f"{'.'.join(path)}({k.arg}=...): no such parameter"
                for k in node.keywords
                if k.arg and not accepts(obj, k.arg)
            ]
    return list(dict.fromkeys(problems))  # an attribute is seen again as the call's function


@pytest.mark.parametrize("block", of("python"))
def test_python_blocks_use_aioq_as_it_is(block: Block) -> None:
    source = textwrap.dedent(block.text)
    assert python_problems(source) == [], block


def test_the_python_check_catches_a_renamed_function_and_a_wrong_keyword() -> None:
    assert python_problems("await aioq.admin.set_queue(conn, 'q', max_running=5)") == []
    assert python_problems("@aioq.task(queue='q')\nasync def f() -> None: ...") == []
    assert python_problems("from aioq.testing import job_context\njob_context(id=1)") == []
    assert python_problems("await aioq.set_queues(conn, 'q')") == [
        "aioq.set_queues: aioq has no 'set_queues'"
    ]
    assert python_problems("@aioq.task(queues='q')\nasync def f() -> None: ...") == [
        "aioq.task(queues=...): no such parameter"
    ]
    assert python_problems("f.options(dealy=3)") == [
        ".options(dealy=...): not an option of Task.options"
    ]
    assert python_problems("from aioq.testing import jobcontext") != []
    assert python_problems("import aioq.webb") == ["import aioq.webb: aioq has no 'webb'"]
    assert python_problems("import aioq.testing as t\nt.job_context(idd=1)") == [
        "t.job_context(idd=...): no such parameter"
    ]
    with pytest.raises(SyntaxError):
        python_problems("async def f(:\n")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.quote], ids=str)
def test_quoted_blocks_are_verbatim_parts_of_their_files(block: Block) -> None:
    assert block.quote is not None
    source = ROOT / block.quote
    assert source.is_file(), f"{block}: {block.quote} does not exist"
    assert block.text in source.read_text(), f"{block} no longer matches {block.quote}"


# --- sh ----------------------------------------------------------------------------------------


def commands(block: Block) -> list[list[str]]:
    """The block's commands as argument lists: continuations joined, comments dropped, each
    command of a pipeline on its own."""
    joined = block.text.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while "|" in words:
            found.append(words[: words.index("|")])
            words = words[words.index("|") + 1 :]
        if words:
            found.append(words)
    return found


def cli_problem(args: list[str]) -> str | None:
    """None if ``aioq ARGS`` parses with the real CLI's parser, else its error line."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            _build_parser().parse_args(args)
        except SystemExit as exc:
            if exc.code:
                return stderr.getvalue().strip() or f"exit {exc.code}"
    return None


def extras_named(text: str) -> set[str]:
    """The extras of ``.[a,b]`` and ``aioq-pg[a,b]`` in a text."""
    return {
        extra.strip()
        for group in re.findall(r"(?:aioq-pg|(?<![\w-])\.)\[([\w, -]+)\]", text)
        for extra in group.split(",")
    }


# Django's own commands the guides use (manage.py and django-admin), and the URLs curl may try.
DJANGO_COMMANDS = {"startproject", "startapp", "migrate", "makemigrations", "runserver", "shell"}
LOCAL = re.compile(r"(https?://)?(localhost|127\.0\.0\.1)(:\d+)?(/\S*)?")


def sh_problems(block: Block) -> list[str]:
    problems = []
    cwd = ROOT
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    for words in commands(block):
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]  # VAR=value command ...
        program, args = words[0], words[1:]
        line = shlex.join(words)
        if program == "aioq":
            if (problem := cli_problem(args)) is not None:
                problems.append(f"{line}: {problem}")
        elif program == "pip":
            problems += [f"{line}: no extra {e!r}" for e in extras_named(line) - EXTRAS]
        elif program == "make":
            problems += [f"{line}: no target {t!r}" for t in args if t not in targets]
        elif program in ("python", "python3") and args[:1] == ["manage.py"]:  # a Django project
            if args[1:2] == ["aioq"]:
                if (problem := cli_problem(args[2:])) is not None:
                    problems.append(f"{line}: {problem}")
            elif args[1] not in DJANGO_COMMANDS:
                problems.append(f"{line}: no manage.py command {args[1]!r}")
        elif program == "django-admin":
            if args[0] not in DJANGO_COMMANDS:
                problems.append(f"{line}: no django-admin command {args[0]!r}")
        elif program == "curl":
            urls = [a for a in args if not a.startswith("-") and a not in ("POST", "GET")]
            problems += [f"{line}: not this machine's {u}" for u in urls if not LOCAL.match(u)]
        elif program in ("python", "python3"):
            if args[:1] != ["-m"] and not (cwd / args[0]).is_file():
                problems.append(f"{line}: no file {cwd / args[0]}")
        elif program == "cd":
            cwd = cwd / args[0]
            if not cwd.is_dir():
                problems.append(f"{line}: no directory {cwd}")
        elif program == "uvicorn":
            factory = next(a for a in args if ":" in a)
            module, attr = factory.split(":")
            if not callable(getattr(importlib.import_module(module), attr, None)):
                problems.append(f"{line}: no {factory}")
        elif program == "export":
            problems += [f"{line}: not NAME=value" for a in args if "=" not in a]
        elif program == "psql":  # the PostgreSQL client, running a script from a pipe
            if not {"-1", "--single-transaction"} & set(args) or "ON_ERROR_STOP=1" not in args:
                problems.append(f"{line}: psql without -1 and ON_ERROR_STOP")
        elif program == "." or program in ("apt-get", "brew"):
            pass  # activating a venv; installing PostgreSQL
        else:
            problems.append(f"{line}: no check for {program!r} (add one to tests/test_docs.py)")
    return problems


@pytest.mark.parametrize("block", of("sh"))
def test_sh_blocks_run_commands_that_exist(block: Block) -> None:
    assert sh_problems(block) == [], block


def test_the_sh_check_catches_unknown_flags_extras_targets_and_programs() -> None:
    def problems(text: str) -> list[str]:
        return sh_problems(Block(ROOT / "README.md", 1, "sh", text, None))

    assert problems("aioq stats --watch 5  # fine\naioq queues set q --rate 100/60s\n") == []
    assert problems("aioq jobs replay --dead \\\n    --task t\n") == []
    [unknown_flag] = problems("aioq stats --whatch 5\n")
    assert "unrecognized arguments: --whatch 5" in unknown_flag
    [bad_value] = problems("aioq queues set q --rate fast\n")
    assert "--rate" in bad_value
    assert problems("pip install '.[server,fastapi]'\n") == [
        "pip install '.[server,fastapi]': no extra 'fastapi'"
    ]
    assert problems("make docs test\nmake tset\n") == ["make tset: no target 'tset'"]
    assert problems("python examples/nope.py\n") == [
        f"python examples/nope.py: no file {ROOT / 'examples/nope.py'}"
    ]
    assert problems("wget http://x\n") == [
        "wget http://x: no check for 'wget' (add one to tests/test_docs.py)"
    ]
    assert problems("curl http://example.com\n") == [
        "curl http://example.com: not this machine's http://example.com"
    ]
    assert problems("python manage.py aioq worker --concurency 2\n")[0].startswith(
        "python manage.py aioq worker --concurency 2:"
    )
    assert problems("python manage.py migrate\ndjango-admin startproject x\n") == []
    assert problems("aioq schema sql | psql -1 -v ON_ERROR_STOP=1 app\n") == []
    piped, _ = problems("aioq schema sql --form 3 | psql app\n")
    assert "unrecognized arguments: --form 3" in piped
    assert problems("aioq schema sql | psql app\n") == [
        "psql app: psql without -1 and ON_ERROR_STOP"
    ]


def cli_words_problem(words: list[str]) -> str | None:
    """None if each command word of ``aioq WORDS`` exists and each ``--flag`` is one it takes.

    For commands quoted in the prose, which name a command and its flags without their values.
    """
    parser = _build_parser()
    for word in words:
        subcommands = next(
            (a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None
        )
        if word.startswith("-"):
            if word.split("=")[0] not in parser._option_string_actions:
                return f"{parser.prog} has no option {word}"
        elif subcommands is not None:
            if word not in subcommands:
                return f"{parser.prog} has no command {word!r}"
            parser = subcommands[word]
    return None


# --- yaml ----------------------------------------------------------------------------------


def yaml_problems(block: Block) -> list[str]:
    """A yaml block must parse; an ``aioq`` command in it (a container's ``command:``) must
    parse with the real CLI's parser."""
    import yaml  # MkDocs' own dependency, in the dev extra

    try:
        document = yaml.safe_load(block.text)
    except yaml.YAMLError as exc:
        return [f"not YAML: {exc}"]
    problems = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            command = node and node[0] == "aioq" and all(isinstance(w, str) for w in node)
            if command and (problem := cli_problem(node[1:])) is not None:
                problems.append(f"{shlex.join(node)}: {problem}")
            for value in node:
                walk(value)

    walk(document)
    return problems


@pytest.mark.parametrize("block", of("yaml"))
def test_yaml_blocks_parse_and_their_aioq_commands_exist(block: Block) -> None:
    assert yaml_problems(block) == [], block


def test_the_yaml_check_catches_bad_yaml_and_a_wrong_flag() -> None:
    def problems(text: str) -> list[str]:
        return yaml_problems(Block(ROOT / "README.md", 1, "yaml", text, None))

    assert problems('command: ["aioq", "worker", "m:r", "--health-port", "1"]\n') == []
    assert problems("a: [1\n")[0].startswith("not YAML")
    [wrong] = problems('command: ["aioq", "worker", "m:r", "--helth-port", "1"]\n')
    assert "--helth-port" in wrong


# --- mermaid -----------------------------------------------------------------------------------


@pytest.mark.parametrize("block", of("mermaid"))
def test_mermaid_blocks_draw_the_state_table(block: Block) -> None:
    assert block.text == mermaid(), f"{block}: paste aioq.states.mermaid() there"


def test_commands_quoted_in_the_prose_exist() -> None:
    """Inline `aioq ...` spans: their commands and flags, whatever the values."""
    spans = [
        (page, shlex.split(span.split("|")[0]))
        for page in PAGES
        for span in re.findall(r"`aioq ([a-z-][^`]*)`", prose(page))
        if "..." not in span
    ]
    assert len(spans) > 30
    problems = [
        f"{page.name}: aioq {shlex.join(words)}: {problem}"
        for page, words in spans
        if (problem := cli_words_problem(words)) is not None
    ]
    assert problems == []
    assert cli_words_problem(["jobs", "replay", "--dead", "--queue", "Q"]) is None
    assert cli_words_problem(["job", "list"]) == "aioq has no command 'job'"
    assert cli_words_problem(["worker", "--no-periodc"]) == "aioq worker has no option --no-periodc"


# --- sql ---------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("block", of("sql"))
async def test_sql_blocks_run_on_a_database_with_the_schema(
    block: Block, conn: asyncpg.Connection
) -> None:
    role = f"app_{secrets.token_hex(4)}"  # for the guides' role `app`: a server may have one
    transaction = conn.transaction()
    await transaction.start()
    try:
        await conn.execute(f"CREATE ROLE {role}")
        await conn.execute(re.sub(r"\bTO app\b", f"TO {role}", block.text))
    finally:
        await transaction.rollback()


# --- links, extras, the site -------------------------------------------------------------------


def slugs(page: Path) -> set[str]:
    """The anchors of a page's headings, as MkDocs (Python-Markdown's toc) and GitHub make them."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE):
        text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        found.add(re.sub(r"[-\s]+", "-", text))
    return found


def test_the_readmes_links_lead_somewhere() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not re.match(r"\w+://", link)]
    assert len(local) >= 10
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {link}: no such file"
        if anchor:
            assert anchor in slugs(target), f"README links to {link}: no such heading"


def test_extras_are_listed_with_what_they_bring_and_every_extra_named_exists() -> None:
    for page in (ROOT / "README.md", DOCS / "getting-started.md"):
        listed = set(re.findall(r"^\| `(\w+)` \|", page.read_text(), re.MULTILINE))
        assert listed == EXTRAS, page.name
    texts = [p.read_text() for p in PAGES]
    texts += [p.read_text() for p in [*ROOT.glob("aioq/**/*.py"), *ROOT.glob("examples/**/*.py")]]
    named = set().union(*(extras_named(text) for text in texts))
    assert named - EXTRAS == set()
    assert {"server", "web", "cron", "testing"} <= named


def test_the_testing_extra_brings_the_http_client_of_the_test_clients() -> None:
    # Starlette's (and so FastAPI's) TestClient imports httpx2; the testing extra installs it.
    testclient = importlib.util.find_spec("starlette.testclient")
    assert testclient is not None
    assert testclient.origin is not None
    assert "import httpx2" in Path(testclient.origin).read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(r.startswith("httpx2") for r in project["optional-dependencies"]["testing"])
    assert "fastapi" not in project["optional-dependencies"]  # aioq never imports FastAPI


def build_site(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    built = build_site(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "getting-started" / "index.html").is_file()
    assert (tmp_path / "site" / "repo" / "benchmarks" / "RESULTS" / "index.html").is_file()
    assert (tmp_path / "site" / "repo" / "examples" / "periodic.py").is_file()
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(page.name in nav for page in DOCS.glob("*.md")), "a page is missing in the nav"


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    for part in ("mkdocs.yml", "docs", "examples", "benchmarks/RESULTS.md", "benchmarks/charts"):
        source, copy = ROOT / part, tmp_path / part
        copy.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, copy)
    assert build_site(tmp_path, tmp_path / "site").returncode == 0
    page = tmp_path / "docs" / "testing.md"
    text = page.read_text()
    for broken in ("[x](fastapi.md#no-such-heading)", "[x](nope.md)", "[x](../examples/nope.py)"):
        page.write_text(text + f"\n{broken}\n")
        built = build_site(tmp_path, tmp_path / "site")
        assert built.returncode == 1, broken
        output = built.stdout + built.stderr
        assert "Aborted with 1 warnings in strict mode" in output, output
        assert broken.split("(")[1].rstrip(")") in output


def test_the_site_directory_is_ignored_by_git() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "site/index.html"], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0


# --- the guides' examples, run -----------------------------------------------------------------


def run_python(script: Path, dsn: str, *args: str, cwd: Path = ROOT) -> str:
    result = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env={**os.environ, "AIOQ_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.timeout(150)
def test_the_readmes_example_prints_what_the_readme_says(dsn: str) -> None:
    printed = run_python(ROOT / "examples" / "first_job.py", dsn)
    assert printed == "receipt for purchase 1 sent by job 1 (attempt 1)\n"
    readme = prose(ROOT / "README.md")
    assert f"prints, on a new database, `{printed.strip()}`" in readme


def jobs_left(dsn: str) -> int:
    async def count() -> int:
        conn = await asyncpg.connect(dsn)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM aioq.jobs"))
        finally:
            await conn.close()

    return asyncio.run(count())


def normalized(text: str) -> list[str]:
    """Output lines with what changes from run to run (times, pids, worker ids) replaced."""
    text = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(,\d+)?Z?", "<time>", text)
    text = re.sub(r"\S+:\d+:[0-9a-f]{6}\b", "<worker>", text)
    text = re.sub(r"\[\d+\]", "[<pid>]", text)
    text = re.sub(r"\d+\.\d{3}s\b", "<s>", text)
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def shown_after(page: Path, command: str) -> list[str]:
    """The output a page shows (its text block) right after the sh block that runs ``command``."""
    blocks = blocks_of(page)
    for block, following in itertools.pairwise(blocks):
        if block.lang == "sh" and command in block.text:
            assert following.lang == "text", f"{page.name}: no output shown after {command!r}"
            return normalized(following.text)
    raise AssertionError(f"{page.name} does not run {command!r}")


@pytest.mark.timeout(200)
def test_getting_started_as_written(dsn: str, tmp_path: Path) -> None:
    """Steps 2 to 5 of the guide through the console script, compared with what it shows."""
    guide = DOCS / "getting-started.md"
    steps = [shlex.join(words) for b in blocks_of(guide) if b.lang == "sh" for words in commands(b)]
    for step in (
        "aioq dev",
        "aioq schema apply",
        "cd examples/getting_started",
        "python place_order.py ada@example.org",
        "python place_order.py bob@flaky.example",
        "aioq jobs list",
        "aioq worker tasks",
    ):
        assert step in steps, step
    app = tmp_path / "getting_started"
    shutil.copytree(ROOT / "examples" / "getting_started", app)

    applied = aioq_cli(dsn, "schema", "apply")
    assert applied.returncode == 0, applied
    assert run_python(app / "place_order.py", dsn, "ada@example.org", cwd=app) == (
        "order 1 placed; its receipt is job 1\n"
    )
    run_python(app / "place_order.py", dsn, "bob@flaky.example", cwd=app)
    listed = aioq_cli(dsn, "jobs", "list", cwd=app)
    assert listed.returncode == 0, listed
    assert normalized(listed.stdout) == shown_after(guide, "aioq jobs list")

    with spawner(dsn) as start:
        worker = start("worker", "tasks", cwd=app)

        wait_for(lambda: jobs_left(dsn) == 0, "both receipts to be sent")
        worker.send_signal(signal.SIGINT)
        out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    printed = normalized(out + err)
    for line in shown_after(guide, "aioq worker tasks"):
        assert line in printed, (line, printed)
    assert "A job that succeeded leaves the table, so `aioq jobs list` now prints `(none)`" in (
        prose(guide)
    )


@pytest.mark.anyio
@pytest.mark.timeout(150)
async def test_periodic_jobs_of_ones_own_registry_run_from_the_worker_command(
    dsn: str, conn: asyncpg.Connection
) -> None:
    # Both schedules were seen an hour ago: the worker enqueues each one's latest missed tick
    # (catch_up's default) at once, instead of waiting for the next.
    for name, spec in (
        ("periodic.purge_expired_carts", "cron 0 3 * * * Europe/Paris"),
        ("periodic.refresh_rates", "every 300s"),
    ):
        await conn.execute(
            "INSERT INTO aioq.schedules (name, task, queue, spec, last_tick)"
            " VALUES ($1, $1, 'default', $2, now() - interval '25 hours')",
            name,
            spec,
        )
    with spawner(dsn) as start:
        worker = start("worker", "periodic:registry", cwd=ROOT / "examples")

        async def ran() -> int:
            return int(
                await conn.fetchval(
                    "SELECT count(*) FROM aioq.schedules s WHERE last_tick > now() - interval"
                    " '25 hours' AND NOT EXISTS (SELECT FROM aioq.jobs j WHERE j.task = s.task)"
                )
            )

        await wait_until(ran, 2)
        listed = await asyncio.to_thread(aioq_cli, dsn, "schedules", "--json")
        worker.send_signal(signal.SIGINT)
        out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert "EUR rates refreshed" in out
    assert re.search(r"carts expired before \d{4}-\d\d-\d\d 0[12]:00 UTC purged", out), out
    assert "periodic.purge_expired_carts" in listed.stdout
    assert "periodic.refresh_rates" in listed.stdout


async def wait_until(check: Any, value: object) -> None:
    from waits import eventually

    async def reached() -> bool:
        return bool(await check() == value)

    await eventually(reached, f"{check.__name__} == {value}")


def test_the_priority_the_guides_state_is_the_order_the_worker_runs(
    dsn: str, tmp_path: Path
) -> None:
    assert "**A higher priority runs first.**" in (DOCS / "tasks.md").read_text()
    (tmp_path / "jobs.py").write_text(
        "import aioq\n\n\n@aioq.task(name='say')\nasync def say(word: str) -> None:\n"
        "    print(word, flush=True)\n"
    )
    for word, priority in (("bulk", "-5"), ("normal", "0"), ("urgent", "10"), ("later", "0")):
        deferred = aioq_cli(
            dsn, "defer", "jobs", "say", "--args", f'{{"word": "{word}"}}', "--priority", priority,
            cwd=tmp_path,
        )  # fmt: skip
        assert deferred.returncode == 0, deferred
    with spawner(dsn) as start:
        worker = start("worker", "jobs", "--concurrency", "1", "--prefetch", "0", cwd=tmp_path)
        wait_for(lambda: jobs_left(dsn) == 0, "the four jobs to run")
        worker.send_signal(signal.SIGINT)
        out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert out.split() == ["urgent", "normal", "later", "bulk"]
