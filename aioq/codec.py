"""JSON for job arguments: exact round trips or a clear error before anything is written.

Arguments are stored as a jsonb object. Only values that come back unchanged are accepted:
``None``, ``bool``, ``int`` within 64 bits, finite ``float``, ``str`` (no NUL, valid
Unicode), ``list`` and ``dict`` with ``str`` keys, nested. Tuples, datetimes, bytes, sets and
other objects are refused rather than silently turned into something else. One exception,
on purpose: ``-0.0`` comes back as ``0.0`` (jsonb numbers have no negative zero); the two
compare equal, and refusing it would make ordinary arithmetic results fail at ``defer``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from aioq.errors import ResultError, SerializationError

__all__ = ("decode_args", "decode_result", "encode_args", "encode_result")

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1


def _problem(value: object, path: str, depth: int) -> tuple[str, str] | None:
    """Return (path, problem) for the first value that would not round-trip, else None."""
    if value is None or value is True or value is False:
        return None
    kind = type(value)
    if kind is str:
        if "\x00" in value:  # type: ignore[operator]
            return path, "contains a NUL character, which PostgreSQL's jsonb cannot store"
        return None
    if kind is int:
        if not _INT_MIN <= value <= _INT_MAX:  # type: ignore[operator]
            return path, "is an integer outside the 64-bit range JSON numbers keep exactly"
        return None
    if kind is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            return path, f"is {value!r}, which JSON cannot represent"
        # orjson writes 1e16 as "1e16"; jsonb prints it as 10000000000000000, read back as an int.
        if 1e16 <= abs(value) <= _INT_MAX:  # type: ignore[arg-type]
            return path, f"is {value!r}, a float that jsonb would return as an int; pass an int"
        return None
    if depth > 200:
        return path, "is nested too deeply"
    if kind is list:
        items: list[object] = value  # type: ignore[assignment]
        for i, item in enumerate(items):
            found = _problem(item, f"{path}[{i}]", depth + 1)
            if found:
                return found
        return None
    if kind is dict:
        mapping: dict[object, object] = value  # type: ignore[assignment]
        for key, item in mapping.items():
            if type(key) is not str:
                return f"{path}[{key!r}]", "has a non-string key; JSON object keys are strings"
            found = _problem(key, f"{path} key {key!r}", depth + 1) or _problem(
                item, f"{path}[{key!r}]", depth + 1
            )
            if found:
                return found
        return None
    return path, (
        f"has type {kind.__name__}, which is not JSON (use None, bool, int, float, str, list"
        " or dict with str keys)"
    )


def _name_problem(name: str) -> tuple[str, str] | None:
    """Return (name, problem) if a keyword argument's name cannot be a jsonb object key."""
    if "\x00" in name:
        return name, "has a NUL character in its name, which PostgreSQL's jsonb cannot store"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name, "has a lone surrogate in its name, which is not valid Unicode"
    return None


def encode_args(task_name: str, args: Mapping[str, object]) -> str:
    """Encode keyword arguments as a JSON object, or raise naming the task and argument."""
    for name, value in args.items():
        found = _name_problem(name) or _problem(value, name, 0)
        if found:
            path, problem = found
            raise SerializationError(task_name, path, problem)
    try:
        return orjson.dumps(args).decode()
    except orjson.JSONEncodeError as exc:  # e.g. lone surrogates in a str
        bad = next(
            (n for n, v in args.items() if _fails_alone(v)),
            next(iter(args), "?"),
        )
        raise SerializationError(task_name, bad, f"cannot be encoded as JSON: {exc}") from exc


def _fails_alone(value: object) -> bool:
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return True
    return False


def decode_args(text: str) -> dict[str, Any]:
    """Decode stored arguments; raise ``ValueError`` unless they are a JSON object."""
    value = orjson.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(value).__name__}")
    return value


def encode_result(task_name: str, job_id: int, value: object) -> str:
    """Encode a task's return value as JSON, or raise ResultError saying what cannot be stored."""
    found = _problem(value, "return value", 0)
    if found:
        path, problem = found
        raise ResultError(task_name, job_id, f"task {task_name!r}: {path} {problem}")
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError as exc:  # e.g. a lone surrogate in a str
        raise ResultError(
            task_name, job_id, f"task {task_name!r}: return value cannot be encoded as JSON: {exc}"
        ) from exc


def decode_result(text: str) -> Any:
    """Decode a stored return value."""
    return orjson.loads(text)
