"""How the pages print numbers, durations and times (Jinja filters)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import jinja2

from aioq.worker.history import BUCKETS

__all__ = ("environment",)


def environment(templates: Path) -> jinja2.Environment:
    """Return the Jinja environment of the templates, with the filters they use."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(count=_count, age=_age, seconds=_seconds, when=_when)
    return env


def _count(value: int, capped: bool = False) -> str:
    return f"{value:,}+" if capped else f"{value:,}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return "0s" if seconds <= 0 else "<1s"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            whole = int(seconds // size)
            rest = int((seconds - whole * size) // (size // 60 if size > 60 else 1))
            small = {"d": "h", "h": "m", "m": "s"}[unit]
            return f"{whole}{unit} {rest}{small}" if rest and unit != "d" else f"{whole}{unit}"
    return f"{int(seconds)}s"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return f">{BUCKETS[-1] / 3600:g}h"
    if value >= 3600:
        return f"{value / 3600:g}h"
    if value >= 60:
        return f"{value / 60:g}m"
    return f"{value * 1000:g}ms" if value < 1 else f"{value:g}s"


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
