"""MkDocs hooks: the repository files the guides link to, built into the site with them.

A guide links to ``../examples/quickstart.py`` or ``../benchmarks/RESULTS.md``, a path that works
where the Markdown is read in the repository. MkDocs only knows the files under ``docs/``, so
this hook adds each of these files under the very path such a link names (``../...``), written
to the site under ``repo/``. The links then resolve on both, and the strict build still fails
on a link to a file that does not exist.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
# Repository files outside docs/ that the guides may link to.
REPOSITORY_FILES = (
    "benchmarks/RESULTS.md",
    "benchmarks/charts/*.png",
    "examples/**/*.py",
    "schema.sql",
)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the repository files the guides link to, as ``../<path>`` (site: ``repo/<path>``)."""
    for pattern in REPOSITORY_FILES:
        for path in sorted(ROOT.glob(pattern)):
            relative = path.relative_to(ROOT).as_posix()
            file = File.generated(
                config,
                f"../{relative}",
                abs_src_path=str(path),
                inclusion=InclusionLevel.INCLUDED,  # a path that starts with a dot is excluded
            )
            file.dest_uri = "repo/" + file.dest_uri.removeprefix("../")
            files.append(file)
    return files
