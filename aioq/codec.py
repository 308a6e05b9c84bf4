"""JSON for job arguments: exact round trips or a clear error before anything is written.

Arguments are stored as a jsonb object. Only values that come back unchanged are accepted:
``None``, ``bool``, ``int`` within 64 bits, finite ``float``, ``str`` (no NUL, valid
Unicode), ``list`` and ``dict`` with ``str`` keys, nested. Tuples, datetimes, bytes, sets and
other objects are refused rather than silently turned into something else. One exception,
on purpose: ``-0.0`` comes back as ``0.0`` (jsonb numbers have no negative zero); the two
compare equal, and refusing it would make ordinary arithmetic results fail at ``defer``.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Collection, Iterable, Mapping
from itertools import compress, repeat
from typing import Any, cast

import orjson

from aioq.errors import ResultError, SerializationError

__all__ = ("decode_args", "decode_result", "encode_args", "encode_result")

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
_MAX_DEPTH = 200

# The fast encoding refuses what orjson would otherwise turn into JSON by a rule of its own
# (subclasses of str, int, float, list and dict, datetimes, dataclasses): none comes back as itself.
_STRICT = (
    orjson.OPT_PASSTHROUGH_SUBCLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
)
_JSON_TYPES = frozenset({type(None), bool, int, float, str, list, dict})
_LEVELS = range(_MAX_DEPTH + 1)
# One byte, as an int: `in` then runs memchr without taking a buffer of the needle.
_BACKSLASH, _PLUS = ord("\\"), ord("+")


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
    if depth > _MAX_DEPTH:
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


def _encode_exact(value: object, level: Collection[object]) -> bytes | None:
    """Return ``value`` as JSON if a quick proof shows it round-trips, else None (ask _problem).

    ``level`` holds the values at depth 0 (the arguments, or the return value itself). The proof
    costs a few C calls per nesting level rather than a Python call per value, and says the same
    as ``_problem`` wherever it says anything (tests/test_codec.py checks it on generated values):

    - orjson with ``_STRICT`` refuses ints beyond 64 bits, non-str keys, lone surrogates,
      subclasses of the JSON types, datetimes and dataclasses;
    - every value has an exact JSON type: no tuple, enum, UUID or other type orjson encodes;
    - floats are finite (orjson writes NaN and infinities as null), looked at only if the text
      has a null at all;
    - the text has no ``\\u0000`` (a NUL, which jsonb refuses) and no ``e+`` (orjson writes a
      float from 1e16 up as 1e+16; jsonb prints it back as 10000000000000000, an int);
    - nesting stops within ``_MAX_DEPTH``.

    A string that happens to hold ``e+`` or ``\\u0000`` only makes the proof fail: ``_problem``
    then decides.
    """
    try:
        encoded = orjson.dumps(value, option=_STRICT)
    except orjson.JSONEncodeError:
        return None
    # One byte first: memchr, where a longer needle walks the whole text.
    if (_BACKSLASH in encoded and b"\\u0000" in encoded) or (_PLUS in encoded and b"e+" in encoded):
        return None
    has_null = None  # looked for once, at the first float
    for _depth in _LEVELS:
        kinds = set(map(type, level))
        if not kinds <= _JSON_TYPES:
            return None
        if float in kinds:
            if has_null is None:
                has_null = b"null" in encoded
            if has_null:
                floats = cast(
                    "Iterable[float]", compress(level, map(isinstance, level, repeat(float)))
                )
                if not all(map(math.isfinite, floats)):
                    return None
        if list not in kinds and dict not in kinds:
            return encoded
        # The next level: the items of the lists and the values of the dicts (their keys are
        # str, orjson made sure), in one call; gc.get_referents skips the scalars.
        level = gc.get_referents(*level)
    return None  # a list or dict deeper than _problem accepts


def encode_args(task_name: str, args: Mapping[str, object]) -> str:
    """Encode keyword arguments as a JSON object, or raise naming the task and argument."""
    encoded = _encode_exact(args, args.values())
    if encoded is not None:
        return encoded.decode()
    return _encode_args_checked(task_name, args)


def _encode_args_checked(task_name: str, args: Mapping[str, object]) -> str:
    """Encode arguments value by value, raising at the first that would not round-trip."""
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
    encoded = _encode_exact(value, (value,))
    if encoded is not None:
        return encoded.decode()
    return _encode_result_checked(task_name, job_id, value)


def _encode_result_checked(task_name: str, job_id: int, value: object) -> str:
    """Encode a return value after walking it, raising at the first part that cannot round-trip."""
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
