"""Python values in, JSON out, and back: the task's annotations are the schema.

Each annotation is compiled once into a :class:`Codec` that checks a value, encodes it into a
plain JSON value and decodes that JSON back into the annotated type (docs/architecture.md,
"Values"; the JSON forms are tabled in docs/tasks.md). A task compiles one codec per parameter
and one for its return annotation, lazily, on first use, so forward references to classes
defined later in its module resolve (:func:`compile_task`).

Annotations of plain JSON types (``int``, ``float``, ``str``, ``bool``, ``None``, ``list`` and
``dict`` of those, a ``TypedDict`` of those) are *plain*: their values are JSON already, are
checked by type (``fast``: the exact types that need no look), and are stored and handed back
as they are. ``Any``, ``object``, an unannotated parameter and an annotation aioq has no form
for pass JSON values as they are, unchecked. Everything else converts: datetimes, UUIDs,
decimals, enums, bytes, tuples, sets, ``Literal``, unions, dataclasses, ``NamedTuple``s, and
pydantic models and types (pydantic is imported only when an annotation needs it).

A codec raises :class:`_Mismatch` (internal) for a value that does not fit; the path inside the
value (``lines[3].sku``) is built only as it unwinds, so a value that fits costs no string.
"""

from __future__ import annotations

import base64
import binascii
import collections.abc
import dataclasses
import enum
import importlib.util
import inspect
import keyword
import logging
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any, ForwardRef, Literal, TypeVar, Union, get_args, get_origin
from uuid import UUID

import orjson
from typing_extensions import get_type_hints, is_typeddict

from aioq.codec import encode_args, encode_result
from aioq.errors import ArgumentError, PayloadError, ResultError

__all__ = (
    "ANY",
    "Codec",
    "TaskCodec",
    "compile_annotation",
    "compile_task",
    "duration_text",
    "explain_mismatch",
    "module_loading",
)

logger = logging.getLogger(__name__)

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]

_NONE = type(None)
_JSON_TYPES = frozenset({_NONE, bool, int, float, str, list, dict})
_MAX_DEPTH = 40  # nesting of annotations (not of values): past it, values pass unchecked


class _Mismatch(Exception):
    """A value that does not fit its annotation: ``problem`` says how, ``steps`` where.

    Each container adds its step (``[3]``, ``.sku``) as the exception passes through it, so
    the steps are innermost first.
    """

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.steps: list[str] = []

    def at(self, step: str) -> _Mismatch:
        """Add the step of the container this value sits in; return self to re-raise."""
        self.steps.append(step)
        return self

    def path(self, root: str) -> str:
        """The path from ``root`` (an argument's name) to the value: ``lines[3].sku``."""
        return root + "".join(reversed(self.steps))


def _shown(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real problem
        text = "<repr() failed>"
    return text if len(text) <= 40 else text[:37] + "..."


def _wrong(expected: str, value: object) -> _Mismatch:
    return _Mismatch(f"must be {expected}, got {type(value).__name__} {_shown(value)}")


def _identity(value: Any) -> Any:
    return value


def _always(value: object) -> bool:
    return True


@dataclass(frozen=True, slots=True, eq=False)
class Codec:
    """One annotation, compiled: check and encode a value, decode its JSON.

    ``fast``: the exact types whose values encode and decode as themselves, with no call (the
    common case, tested in C: ``type(v) in fast``). ``plain``: ``encode`` returns the value
    itself (it is JSON already) once checked. For unions: ``fits`` says whether a Python value
    is of this member's type, ``forms`` which JSON types its encoding takes, and ``exact``
    whether a JSON value is certainly this member's (an object with no key the member lacks).
    """

    label: str
    encode: Encode
    decode: Decode
    fast: frozenset[type] = frozenset()
    plain: bool = False
    fits: Callable[[Any], bool] = _always
    forms: frozenset[type] = _JSON_TYPES
    exact: Callable[[Any], bool] | None = None
    # (a type, its JSON text of a value of exactly that type, the value of a JSON string): what
    # the compiled code of a class calls directly for a field of this codec (_compiled_object).
    direct: tuple[type, Callable[[Any], str], Callable[[str], Any]] | None = None


ANY = Codec("Any", _identity, _identity, _JSON_TYPES, plain=True)
"""``Any``, ``object``, no annotation: JSON values as they are (the JSON encoder checks them)."""


def _types(*kinds: type) -> Callable[[Any], bool]:
    def fits(value: object) -> bool:
        return type(value) in kinds

    return fits


def _instance(kind: type | tuple[type, ...]) -> Callable[[Any], bool]:
    def fits(value: object) -> bool:
        return isinstance(value, kind)

    return fits


# --- plain JSON types --------------------------------------------------------------------------


def _scalar(label: str, *kinds: type) -> Codec:
    fast = frozenset(kinds)

    # type() rather than isinstance: bool is an int subclass, and the JSON encoder stores only
    # exact built-in types anyway.
    def check(value: object) -> object:
        if type(value) in fast:
            return value
        raise _wrong(label, value)

    return Codec(label, check, check, fast, plain=True, fits=_types(*kinds), forms=fast)


_SCALARS = {
    int: _scalar("int", int),
    float: _scalar("float", float, int),
    str: _scalar("str", str),
    bool: _scalar("bool", bool),
    _NONE: _scalar("None", _NONE),
}


def _items(convert: Callable[[Any], Any], items: Any, step: Callable[[int, Any], str]) -> None:
    """Find the item ``convert`` refuses and raise its _Mismatch with the item's step."""
    for i, item in enumerate(items):
        try:
            convert(item)
        except _Mismatch as exc:
            raise exc.at(step(i, item)) from None


def _index(i: int, item: object) -> str:
    return f"[{i}]"


def _list(item: Codec | None, label: str) -> Codec:
    """``list[X]``: a JSON array."""
    if item is None or item is ANY:  # bare list, list[Any]: its items are not looked at
        return _scalar(label, list)
    fast, enc, dec = item.fast, item.encode, item.decode
    if item.plain:

        def check(value: Any) -> Any:
            if type(value) is not list:
                raise _wrong(label, value)
            if not set(map(type, value)) <= fast:  # in C for a list of ints or plain dicts
                _items(enc, value, _index)
            return value

        def decode_plain(value: Any) -> Any:
            if type(value) is not list:
                raise _wrong(label, value)
            if set(map(type, value)) <= fast:
                return value
            try:
                return list(map(dec, value))  # a TypedDict item may drop keys it no longer has
            except _Mismatch:
                _items(dec, value, _index)
                raise

        forms = frozenset({list})
        return Codec(label, check, decode_plain, plain=True, fits=_types(list), forms=forms)
    return _sequence(item, label, list, list)


def _sequence(item: Codec, label: str, accepts: type | tuple[type, ...], build: type) -> Codec:
    """A list, tuple, set or frozenset of values that convert: a JSON array either way."""
    enc, dec = item.encode, item.decode
    fits = _instance(accepts)  # a call, not isinstance: mypy would narrow value to object

    def encode(value: Any) -> Any:
        if not fits(value):
            raise _wrong(label, value)
        try:
            return list(map(enc, value))
        except _Mismatch:
            _items(enc, value, _index)
            raise

    def decode(value: Any) -> Any:
        if type(value) is not list:
            raise _wrong(label, value)
        try:
            return build(map(dec, value))
        except _Mismatch:
            _items(dec, value, _index)
            raise
        except TypeError as exc:  # an item that is not hashable in a set
            raise _Mismatch(f"cannot be read as {label}: {exc}") from None

    return Codec(label, encode, decode, fits=fits, forms=frozenset({list}))


def _plain_set(item: Codec, label: str, build: type) -> Codec:
    """``set[X]`` / ``frozenset[X]`` of plain items: a JSON array."""
    fast, enc, dec = item.fast, item.encode, item.decode

    def encode(value: Any) -> Any:
        if not isinstance(value, set | frozenset):
            raise _wrong(label, value)
        items = list(value)
        if not set(map(type, items)) <= fast:
            _items(enc, items, _index)
        return items

    def decode(value: Any) -> Any:
        if type(value) is not list:
            raise _wrong(label, value)
        if not set(map(type, value)) <= fast:
            _items(dec, value, _index)
        try:
            return build(value)
        except TypeError as exc:
            raise _Mismatch(f"cannot be read as {label}: {exc}") from None

    fits = _instance((set, frozenset))
    return Codec(label, encode, decode, fits=fits, forms=frozenset({list}))


def _tuple(items: list[Codec], label: str) -> Codec:
    """``tuple[X, Y]``: a JSON array of exactly that length."""
    size = len(items)
    encoders = [c.encode for c in items]
    decoders = [c.decode for c in items]

    def encode(value: Any) -> Any:
        if not isinstance(value, tuple) or len(value) != size:
            raise _wrong(label, value)
        out = []
        for i, (convert, item) in enumerate(zip(encoders, value, strict=True)):
            try:
                out.append(convert(item))
            except _Mismatch as exc:
                raise exc.at(f"[{i}]") from None
        return out

    def decode(value: Any) -> Any:
        if type(value) is not list or len(value) != size:
            raise _wrong(f"{label} (a JSON array of {size})", value)
        out = []
        for i, (convert, item) in enumerate(zip(decoders, value, strict=True)):
            try:
                out.append(convert(item))
            except _Mismatch as exc:
                raise exc.at(f"[{i}]") from None
        return tuple(out)

    return Codec(label, encode, decode, fits=_instance(tuple), forms=frozenset({list}))


# --- dict keys ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Key:
    """How a dict key is written as a JSON object key (always text) and read back."""

    label: str
    encode: Callable[[Any], str] | None  # None: str keys, as they are
    decode: Callable[[str], Any] | None


_INT_TEXT = re.compile(r"-?[0-9]+")


def _int_key_out(key: Any) -> str:
    if type(key) is not int:
        raise _wrong("int", key)
    return str(key)


def _int_key_in(text: str) -> Any:
    if _INT_TEXT.fullmatch(text) is None:
        raise _wrong("an integer key", text)
    return int(text)


def _uuid_key_out(key: Any) -> str:
    if not isinstance(key, UUID):
        raise _wrong("UUID", key)
    return str(key)


def _uuid_key_in(text: str) -> Any:
    try:
        return UUID(text)
    except ValueError:
        raise _wrong("a UUID key", text) from None


def _key(tp: Any) -> _Key | None:
    """The key codec of ``dict[K, V]``; None: a key type aioq has no JSON form for."""
    if tp is str:
        return _Key("str", None, None)
    if tp is int:
        return _Key("int", _int_key_out, _int_key_in)
    if tp is UUID:
        return _Key("UUID", _uuid_key_out, _uuid_key_in)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        table = _enum_table(tp)
        if table is None:
            return None
        out = {member: str(value) for member, value in table.items()}
        back = {text: member for member, text in out.items()}
        label = tp.__name__

        def encode(key: Any) -> str:
            try:
                return out[key]
            except (KeyError, TypeError):
                raise _wrong(label, key) from None

        def decode(text: str) -> Any:
            try:
                return back[text]
            except KeyError:
                raise _wrong(f"a {label} key", text) from None

        return _Key(label, encode, decode)
    return None


def _dict(key: _Key | None, value: Codec | None, label: str) -> Codec:
    """``dict[K, V]``: a JSON object; keys other than str are written as text."""
    forms = frozenset({dict})
    value = ANY if value is None else value
    if key is None or key.encode is None:  # str keys (or keys aioq cannot convert: as they are)
        if value is ANY:  # bare dict, dict[str, Any]: its values are not looked at
            return _scalar(label, dict)
        if value.plain:
            fast, enc, dec = value.fast, value.encode, value.decode

            def check(data: Any) -> Any:
                if type(data) is not dict:
                    raise _wrong(label, data)
                if not set(map(type, data.values())) <= fast:
                    for name, item in data.items():
                        try:
                            enc(item)
                        except _Mismatch as exc:
                            raise exc.at(f"[{name!r}]") from None
                return data

            def decode_plain(data: Any) -> Any:
                if type(data) is not dict:
                    raise _wrong(label, data)
                if set(map(type, data.values())) <= fast:
                    return data
                out = {}
                for name, item in data.items():
                    try:
                        out[name] = dec(item)
                    except _Mismatch as exc:
                        raise exc.at(f"[{name!r}]") from None
                return out

            return Codec(label, check, decode_plain, plain=True, fits=_types(dict), forms=forms)
    key_out = key.encode if key is not None and key.encode is not None else _identity
    key_in = key.decode if key is not None and key.decode is not None else _identity
    enc, dec = value.encode, value.decode

    def encode(data: Any) -> Any:
        if not isinstance(data, dict):
            raise _wrong(label, data)
        out = {}
        for name, item in data.items():
            try:
                text = key_out(name)
            except _Mismatch as exc:
                raise _Mismatch(f"has the key {_shown(name)}, which {exc.problem}") from None
            try:
                out[text] = enc(item)
            except _Mismatch as exc:
                raise exc.at(f"[{name!r}]") from None
        return out

    def decode(data: Any) -> Any:
        if type(data) is not dict:
            raise _wrong(label, data)
        out = {}
        for text, item in data.items():
            try:
                name = key_in(text)
            except _Mismatch as exc:
                raise _Mismatch(f"has the key {text!r}, which {exc.problem}") from None
            try:
                out[name] = dec(item)
            except _Mismatch as exc:
                raise exc.at(f"[{name!r}]") from None
        return out

    return Codec(label, encode, decode, fits=_instance(dict), forms=forms)


# --- scalars that convert ------------------------------------------------------------------------


def _text_codec(
    label: str,
    kind: type | tuple[type, ...],
    out: Callable[[Any], str],
    back: Callable[[str], Any],
    form: str,
    refuse: type | None = None,
) -> Codec:
    """A type written as a JSON string: ``out`` writes it, ``back`` reads it (ValueError)."""

    def fits(value: object) -> bool:
        return isinstance(value, kind) and not (refuse is not None and isinstance(value, refuse))

    def encode(value: Any) -> Any:
        if not fits(value):
            raise _wrong(label, value)
        return out(value)

    def decode(value: Any) -> Any:
        if type(value) is not str:
            raise _wrong(f"{label} ({form})", value)
        try:
            return back(value)
        except (ValueError, TypeError):
            raise _wrong(f"{label} ({form})", value) from None

    direct = (kind, out, back) if isinstance(kind, type) and refuse is None else None
    if kind is date:  # a datetime is a date too: only an exact date goes the direct way
        direct = (date, out, back)
    return Codec(label, encode, decode, fits=fits, forms=frozenset({str}), direct=direct)


def _uuid_text(value: UUID) -> str:
    """``str(value)``, the canonical form, written by orjson (a third of ``UUID.__str__``)."""
    if type(value) is not UUID:
        return str(value)
    return orjson.dumps(value)[1:-1].decode()


def _uuid_in(text: str) -> UUID:
    """``UUID(text)``: the common form read without its replace and strip calls."""
    digits = text.replace("-", "")
    if len(digits) == 32 and len(text) in (32, 36):
        return UUID(int=int(digits, 16))
    return UUID(text)


def _isoformat(value: datetime | date | time) -> str:
    return value.isoformat()


def _b64(value: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(value).decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(str(exc)) from None


def _decimal_in(text: str) -> Decimal:
    try:
        return Decimal(text)
    except InvalidOperation:
        raise ValueError(text) from None


def _decimal() -> Codec:
    """``Decimal``: a JSON string, exact; a JSON integer is read too (it is exact)."""

    def encode(value: Any) -> Any:
        if not isinstance(value, Decimal):
            raise _wrong("Decimal", value)
        return str(value)

    def decode(value: Any) -> Any:
        kind = type(value)
        if kind is str:
            try:
                return Decimal(value)
            except InvalidOperation:
                raise _wrong("Decimal (a decimal number as a string)", value) from None
        if kind is int:
            return Decimal(value)
        if kind is float:
            # orjson read the number into a binary float: its digits may not be the stored ones.
            raise _Mismatch(
                f'must be Decimal as a string ("{value!r}"), got the JSON number {value!r}:'
                " a number with a fraction is read through a binary float, which may change it"
            )
        raise _wrong("Decimal (a decimal number as a string)", value)

    fits = _instance(Decimal)
    forms = frozenset({str, int, float})
    return Codec("Decimal", encode, decode, fits=fits, forms=forms, direct=(Decimal, str, Decimal))


# An ISO 8601 duration as pydantic writes it (P1DT2H3M4.5S, -PT1S), also with weeks, and years
# and months as pydantic reads them (365 and 30 days).
_DURATION = re.compile(
    r"(?P<sign>[-+]?)P(?:(?P<years>\d+(?:\.\d+)?)Y)?(?:(?P<months>\d+(?:\.\d+)?)M)?"
    r"(?:(?P<weeks>\d+(?:\.\d+)?)W)?(?:(?P<days>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<hours>\d+(?:\.\d+)?)H)?(?:(?P<minutes>\d+(?:\.\d+)?)M)?"
    r"(?:(?P<seconds>\d+(?:\.\d+)?)S)?)?"
)
_DAYS = {"years": 365, "months": 30, "weeks": 7, "days": 1}
_SECONDS = {"hours": 3600, "minutes": 60, "seconds": 1}


def duration_text(value: timedelta) -> str:
    """A timedelta as an ISO 8601 duration: ``P1DT2H3M4.5S``, ``-PT1S``, ``PT0S``."""
    sign = "-" if value < timedelta(0) else ""
    value = abs(value)
    days, seconds, micro = value.days, value.seconds, value.microseconds
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    time_part = ""
    if hours:
        time_part += f"{hours}H"
    if minutes:
        time_part += f"{minutes}M"
    if seconds or micro:
        fraction = f".{micro:06d}".rstrip("0") if micro else ""
        time_part += f"{seconds}{fraction}S"
    if not days and not time_part:
        return "PT0S"
    return f"{sign}P{f'{days}D' if days else ''}{f'T{time_part}' if time_part else ''}"


def _duration_in(text: str) -> timedelta:
    found = _DURATION.fullmatch(text)
    if found is None or text.endswith(("P", "T")):
        raise ValueError(text)
    seconds = Decimal(0)
    for name, n in (*_DAYS.items(), *_SECONDS.items()):
        seconds += Decimal(found[name] or 0) * n * (86400 if name in _DAYS else 1)
    whole = int(seconds)
    total = timedelta(seconds=whole, microseconds=round((seconds - whole) * 1_000_000))
    return -total if found["sign"] == "-" else total


def _timedelta() -> Codec:
    """``timedelta``: an ISO 8601 duration string; a JSON number of seconds is read too."""

    def encode(value: Any) -> Any:
        if not isinstance(value, timedelta):
            raise _wrong("timedelta", value)
        return duration_text(value)

    def decode(value: Any) -> Any:
        kind = type(value)
        try:
            if kind is str:
                return _duration_in(value)
            if kind is int or kind is float:
                return timedelta(seconds=value)
        except (ValueError, OverflowError):
            pass
        raise _wrong("timedelta (an ISO 8601 duration, or seconds)", value)

    forms = frozenset({str, int, float})
    return Codec("timedelta", encode, decode, fits=_instance(timedelta), forms=forms)


_CONVERTED: dict[object, Codec] = {
    datetime: _text_codec(
        "datetime", datetime, _isoformat, datetime.fromisoformat, "ISO 8601 text"
    ),
    date: _text_codec("date", date, _isoformat, date.fromisoformat, "ISO 8601 text", datetime),
    time: _text_codec("time", time, _isoformat, time.fromisoformat, "ISO 8601 text"),
    UUID: _text_codec("UUID", UUID, _uuid_text, _uuid_in, "a UUID string"),
    bytes: _text_codec("bytes", (bytes, bytearray, memoryview), _b64, _unb64, "base64 text"),
    Decimal: _decimal(),
    timedelta: _timedelta(),
}


# --- enums and literals --------------------------------------------------------------------------


def _json_value(value: object) -> object | None:
    """A member's value as the exact JSON scalar it is stored as; None if it is none."""
    if value is None or type(value) in (bool, str, int, float):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return None


def _enum_table(tp: type[enum.Enum]) -> dict[Any, Any] | None:
    """Each member and the JSON scalar it is stored as (its value); None if one has no such."""
    table = {}
    for member in tp.__members__.values():
        value = _json_value(member.value)
        if value is None and member.value is not None:
            return None
        table[member] = value
    return table


def _enum(tp: type[enum.Enum]) -> Codec | None:
    """An Enum (IntEnum, StrEnum, Flag...): stored by value."""
    table = _enum_table(tp)
    if table is None:
        return None
    back = {(type(value), value): member for member, value in table.items()}
    label = tp.__name__
    flag = issubclass(tp, enum.Flag)

    def encode(value: Any) -> Any:
        if not isinstance(value, tp):
            raise _wrong(label, value)
        found = table.get(value)
        if found is None and value not in table:  # a combination of flags
            return _json_value(value.value)
        return found

    def decode(value: Any) -> Any:
        try:
            return back[(type(value), value)]
        except (KeyError, TypeError):  # TypeError: a JSON array or object, no member's value
            pass
        if flag and type(value) is int:
            try:
                return tp(value)
            except ValueError:
                pass
        values = ", ".join(_shown(v) for v in list(table.values())[:8])
        raise _Mismatch(f"must be a value of {label} ({values}), got {_shown(value)}")

    forms = frozenset(type(v) for v in table.values())
    return Codec(label, encode, decode, fits=_instance(tp), forms=forms)


def _literal(values: tuple[object, ...]) -> Codec | None:
    """``Literal[...]``: one of these values (enum members by their value)."""
    out: dict[tuple[type, object], object] = {}
    for value in values:
        stored = _json_value(value.value if isinstance(value, enum.Enum) else value)
        if stored is None and value is not None:
            return None
        out[(type(value), value)] = stored
    back = {(type(stored), stored): value for (_, value), stored in out.items()}
    shown = (
        f"{type(v).__name__}.{v.name}" if isinstance(v, enum.Enum) else repr(v) for v in values
    )
    label = f"Literal[{', '.join(shown)}]"

    def fits(value: object) -> bool:
        try:
            return (type(value), value) in out
        except TypeError:  # unhashable
            return False

    def encode(value: Any) -> Any:
        if not fits(value):
            raise _wrong(label, value)
        return out[(type(value), value)]

    def decode(value: Any) -> Any:
        try:
            return back[(type(value), value)]
        except (KeyError, TypeError):
            raise _wrong(label, value) from None

    forms = frozenset(type(v) for v in out.values())
    return Codec(label, encode, decode, fits=fits, forms=forms)


# --- unions --------------------------------------------------------------------------------------


def _union(members: list[Codec]) -> Codec:
    """``X | Y``: encoded by the first member the value fits (by type, in the order written);
    decoded by the first member that reads it, plain JSON types first (a JSON string is a
    ``str`` before it is a ``UUID``), then the others in the order written, those that
    certainly match (no unknown keys) before the others."""
    label = " | ".join(m.label for m in members)
    fast = frozenset().union(*(m.fast for m in members if m.plain))
    if all(m.plain for m in members):
        checks = [m.encode for m in members]
        decoders = [m.decode for m in members]
        others = [m for m in members if m.label != "None"]
        optional = len(others) == 1 and len(members) == 2  # X | None

        def check(value: Any) -> Any:
            if optional and value is not None:
                return others[0].encode(value)  # says which part of an X failed
            for member in checks:
                try:
                    return member(value)
                except _Mismatch:
                    continue
            raise _wrong(label, value)

        def decode_plain(value: Any) -> Any:
            if optional and value is not None:
                return others[0].decode(value)
            for member in decoders:
                try:
                    return member(value)
                except _Mismatch:
                    continue
            raise _wrong(label, value)

        return Codec(label, check, decode_plain, fast, plain=True, fits=_fits_any(members))
    others = [m for m in members if m.label != "None"]
    if len(others) == 1 and len(members) == 2:  # X | None, X converts
        inner = others[0]
        enc, dec = inner.encode, inner.decode

        def encode_optional(value: Any) -> Any:
            return None if value is None else enc(value)

        def decode_optional(value: Any) -> Any:
            return None if value is None else dec(value)

        fits = _fits_any(members)
        forms = inner.forms | {_NONE}
        return Codec(label, encode_optional, decode_optional, fast, fits=fits, forms=forms)
    plain_first = [m for m in members if m.plain] + [m for m in members if not m.plain]

    def encode(value: Any) -> Any:
        candidates = [m for m in members if m.fits(value)]
        for member in candidates:
            try:
                return member.encode(value)
            except _Mismatch as exc:
                if len(candidates) == 1:
                    raise exc from None  # the one member of its type says what is wrong
        raise _wrong(label, value)

    def decode(value: Any) -> Any:
        kind = type(value)
        candidates = [m for m in plain_first if kind in m.forms]
        certain = [m for m in candidates if m.exact is not None and m.exact(value)]
        for member in certain + [m for m in candidates if m not in certain]:
            try:
                return member.decode(value)
            except _Mismatch as exc:
                if len(candidates) == 1:
                    raise exc from None
        raise _wrong(label, value)

    forms = frozenset().union(*(m.forms for m in members))
    return Codec(label, encode, decode, fast, fits=_fits_any(members), forms=forms)


def _fits_any(members: list[Codec]) -> Callable[[Any], bool]:
    tests = [m.fits for m in members]

    def fits(value: object) -> bool:
        return any(test(value) for test in tests)

    return fits


# --- objects: dataclasses, NamedTuples, TypedDicts -----------------------------------------------


@dataclass(slots=True)
class _Field:
    name: str
    codec: Codec
    required: bool


def _object_codec(label: str, fields: list[_Field], cls: type, *, by_name: bool) -> Codec:
    """A class written as a JSON object of its fields (dataclass, NamedTuple).

    ``by_name``: read each field as an attribute (a dataclass), else the instance is the tuple
    of its fields in order (a NamedTuple). Reading JSON, a key the class no longer has is
    ignored and a field it lacks takes its default: a job of an older shape still runs.
    """
    plan = tuple((f.name, f.codec.fast, f.codec.encode, f.codec.decode) for f in fields)
    names = frozenset(f.name for f in fields)
    required = frozenset(f.name for f in fields if f.required)

    fits = _instance(cls)

    def encode(value: Any) -> Any:
        if not fits(value):
            raise _wrong(label, value)
        out = {}
        name = ""
        try:
            if by_name:
                for name, fast, enc, _ in plan:
                    item = getattr(value, name)
                    out[name] = item if type(item) in fast else enc(item)
            else:
                for (name, fast, enc, _), item in zip(plan, value):  # noqa: B905
                    out[name] = item if type(item) in fast else enc(item)
        except _Mismatch as exc:
            raise exc.at(f".{name}") from None
        return out

    def decode(data: Any) -> Any:
        if type(data) is not dict:
            raise _wrong(f"{label} (a JSON object)", data)
        if not required <= data.keys():
            missing = sorted(required - data.keys())
            raise _Mismatch(f"lacks the field {missing[0]!r}, which {label} requires")
        kwargs = {}
        name = ""
        try:
            for name, fast, _, dec in plan:
                if name in data:
                    item = data[name]
                    kwargs[name] = item if type(item) in fast else dec(item)
        except _Mismatch as exc:
            raise exc.at(f".{name}") from None
        try:
            return cls(**kwargs)
        except Exception as exc:  # the class's own checks (__post_init__) refused it
            raise _Mismatch(f"cannot be made a {label}: {type(exc).__name__}: {exc}") from None

    def exact(data: Any) -> bool:
        return bool(data.keys() <= names)

    compiled = _compiled_object(fields, cls, by_name, encode, decode)
    encoder, decoder = (encode, decode) if compiled is None else compiled
    return Codec(label, encoder, decoder, fits=fits, forms=frozenset({dict}), exact=exact)


def _compiled_object(
    fields: list[_Field], cls: type, by_name: bool, encode: Encode, decode: Decode
) -> tuple[Encode, Decode] | None:
    """Straight-line code for a class's fields, in front of the generic loops above.

    Each field is read, checked by its exact type and converted in one expression (a UUID's
    ``str``, a datetime's ``isoformat``, as the field's codec would), with no loop and no call
    for plain values; anything else (a subclass, a field missing its key, a value that does not
    fit, a class whose __post_init__ refuses) goes to the generic code, which decides and names
    what is wrong. The two give the same results: this is only the common case made fast (as
    ``dataclasses`` compiles ``__init__``). None when a field's name is not an identifier.
    """
    if not all(f.name.isidentifier() and not keyword.iskeyword(f.name) for f in fields):
        return None
    names: dict[str, Any] = {"cls": cls, "slow_encode": encode, "slow_decode": decode}
    out_lines, in_lines = [], []
    for i, f in enumerate(fields):
        codec = f.codec
        names[f"F{i}"], names[f"E{i}"], names[f"D{i}"] = codec.fast, codec.encode, codec.decode
        read = f"value.{f.name}" if by_name else f"value[{i}]"
        if codec.direct is not None:
            names[f"K{i}"], names[f"T{i}"], names[f"R{i}"] = codec.direct
            out_lines.append(
                f"        v = {read}; x{i} = T{i}(v) if v.__class__ is K{i} else E{i}(v)"
            )
            in_lines.append(
                f"        v = data[{f.name!r}]; x{i} = R{i}(v) if v.__class__ is str else D{i}(v)"
            )
        else:
            out_lines.append(f"        v = {read}; x{i} = v if v.__class__ in F{i} else E{i}(v)")
            in_lines.append(
                f"        v = data[{f.name!r}]; x{i} = v if v.__class__ in F{i} else D{i}(v)"
            )
    result = ", ".join(f"{f.name!r}: x{i}" for i, f in enumerate(fields))
    call = ", ".join(f"{f.name}=x{i}" for i, f in enumerate(fields))
    source = "\n".join(
        [
            "def encode(value):",
            "    if value.__class__ is not cls:",
            "        return slow_encode(value)",
            "    try:",
            *out_lines,
            "    except Exception:",
            "        return slow_encode(value)",
            f"    return {{{result}}}",
            "def decode(data):",
            "    if data.__class__ is not dict:",
            "        return slow_decode(data)",
            "    try:",
            *in_lines,
            f"        return cls({call})",
            "    except Exception:",
            "        return slow_decode(data)",
        ]
    )
    exec(compile(source, f"<aioq codec of {cls.__qualname__}>", "exec"), names)
    return names["encode"], names["decode"]


def _typed_dict(label: str, fields: list[_Field]) -> Codec:
    """A TypedDict: a JSON object with its required keys. At defer, no other key is accepted;
    reading, keys it no longer declares are dropped."""
    declared = frozenset(f.name for f in fields)
    required = frozenset(f.name for f in fields if f.required)
    codecs = {f.name: f.codec for f in fields}
    plain = all(c.plain for c in codecs.values())

    def keys_fit(data: dict[str, Any], exact: bool) -> None:
        keys = data.keys()
        for key in required:
            if key not in keys:
                raise _Mismatch(f"lacks the key {key!r}, which {label} requires")
        if exact:
            for key in keys:
                if key not in declared:
                    raise _Mismatch(f"has the key {key!r}, which {label} does not declare")

    def encode(data: Any) -> Any:
        if type(data) is not dict:
            raise _wrong(label, data)
        if not (required <= data.keys() <= declared):  # the common case, in C
            keys_fit(data, exact=True)
        out = data if plain else {}
        for key, item in data.items():
            codec = codecs[key]
            if type(item) in codec.fast:
                if not plain:
                    out[key] = item
                continue
            try:
                converted = codec.encode(item)
            except _Mismatch as exc:
                raise exc.at(f"[{key!r}]") from None
            if not plain:
                out[key] = converted
        return out

    def decode(data: Any) -> Any:
        if type(data) is not dict:
            raise _wrong(label, data)
        keys = data.keys()
        if not required <= keys:
            keys_fit(data, exact=False)
        if plain and keys <= declared:
            for key, item in data.items():
                codec = codecs[key]
                if type(item) not in codec.fast:
                    try:
                        codec.decode(item)
                    except _Mismatch as exc:
                        raise exc.at(f"[{key!r}]") from None
            return data
        out = {}
        for key, item in data.items():
            known = codecs.get(key)
            if known is None:
                continue  # a key it no longer declares
            try:
                out[key] = item if type(item) in known.fast else known.decode(item)
            except _Mismatch as exc:
                raise exc.at(f"[{key!r}]") from None
        return out

    def exact(data: Any) -> bool:
        return bool(data.keys() <= declared)

    fits = _types(dict)
    return Codec(
        label, encode, decode, plain=plain, fits=fits, forms=frozenset({dict}), exact=exact
    )


# --- pydantic ------------------------------------------------------------------------------------


def _pydantic_type(tp: Any) -> bool:
    """Whether pydantic should read this type: a model, a pydantic dataclass, a type with a
    pydantic schema. Looked up in sys.modules: without pydantic imported, none can exist."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is None or not isinstance(tp, type):
        return False
    return (
        issubclass(tp, pydantic.BaseModel)
        or "__pydantic_validator__" in vars(tp)
        or hasattr(tp, "__get_pydantic_core_schema__")
    )


def _pydantic_metadata(metadata: tuple[object, ...]) -> bool:
    """Whether ``Annotated`` metadata holds pydantic constraints (Field, Gt, validators...)."""
    return any(
        type(m).__module__.partition(".")[0] in ("pydantic", "annotated_types") for m in metadata
    )


_pydantic_installed: bool | None = None


def _pydantic_available() -> bool:
    """Whether pydantic can be imported (looked up once; imported only when used)."""
    global _pydantic_installed
    if _pydantic_installed is None:
        _pydantic_installed = importlib.util.find_spec("pydantic") is not None
    return _pydantic_installed


def _pydantic(tp: Any, label: str, *, fallback: bool = False) -> Codec | None:
    """A type pydantic reads and writes: stored as pydantic's JSON mode writes it
    (``dump_python(mode="json")``), read back by ``validate_json``. ``fallback``: a type aioq
    has no form for; None if pydantic cannot take it either."""
    import pydantic
    import pydantic_core

    try:
        adapter: Any = pydantic.TypeAdapter(tp)
    except Exception:
        if fallback:
            return None
        raise
    model = isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)
    fits = _instance(tp) if model else _always
    invalid: type[Exception] = pydantic.ValidationError
    unwritable: type[Exception] = pydantic_core.PydanticSerializationError

    def encode(value: Any) -> Any:
        if not fits(value):
            raise _wrong(label, value)
        try:
            checked = value if model else adapter.validate_python(value, strict=True)
            return adapter.dump_python(checked, mode="json", warnings="error")
        except invalid as exc:
            raise _from_pydantic(exc) from None
        except unwritable as exc:
            raise _Mismatch(f"cannot be written as JSON by pydantic: {exc}") from None

    def decode(value: Any) -> Any:
        try:
            return adapter.validate_json(orjson.dumps(value))
        except invalid as exc:
            raise _from_pydantic(exc) from None

    forms = frozenset({dict}) if model else _JSON_TYPES
    return Codec(label, encode, decode, fits=fits, forms=forms)


def _from_pydantic(exc: Any) -> _Mismatch:
    """The first error of a pydantic ValidationError, with its location as steps."""
    first = exc.errors()[0]
    given = first.get("input")
    problem = f"{first['msg'][0].lower()}{first['msg'][1:]} (pydantic), got {_shown(given)}"
    mismatch = _Mismatch(f"is invalid: {problem}")
    for step in reversed(first.get("loc", ())):
        mismatch.at(f"[{step}]" if isinstance(step, int) else f".{step}")
    return mismatch


# --- compiling -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Context:
    """What compiling one task's annotations shares: names to resolve strings in, the classes
    already compiled (a recursive dataclass refers to itself), whether every name resolved."""

    namespace: dict[str, Any]
    memo: dict[Any, Codec] = field(default_factory=dict)
    unresolved: list[str] = field(default_factory=list)


class _Forward:
    """A class's codec while it is being compiled: a field of it that refers back to it."""

    def __init__(self) -> None:
        self.target: Codec | None = None

    def encode(self, value: Any) -> Any:
        assert self.target is not None
        return self.target.encode(value)

    def decode(self, value: Any) -> Any:
        assert self.target is not None
        return self.target.decode(value)

    def fits(self, value: Any) -> bool:
        assert self.target is not None
        return self.target.fits(value)


def compile_annotation(tp: Any, namespace: dict[str, Any] | None = None) -> Codec:
    """Compile an annotation into its codec (``ANY`` for one aioq has no form for)."""
    return _compile(tp, _Context(namespace or {}), 0) or ANY


def _label(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return repr(tp).replace("typing.", "")


def _compile(tp: Any, ctx: _Context, depth: int) -> Codec | None:
    """The codec of an annotation; None: any JSON value, unchecked."""
    if depth > _MAX_DEPTH or tp is Any or tp is object or tp is inspect.Parameter.empty:
        return None
    if isinstance(tp, str | ForwardRef):
        text = tp if isinstance(tp, str) else tp.__forward_arg__
        try:
            tp = eval(text, ctx.namespace)  # the annotation's own module's text
        except Exception as exc:
            ctx.unresolved.append(f"{text!r} ({type(exc).__name__}: {exc})")
            return None
    if tp is None or tp is _NONE:
        return _SCALARS[_NONE]
    try:
        hash(tp)
    except TypeError:  # an unhashable annotation (Annotated metadata): no table lookups
        pass
    else:
        found = ctx.memo.get(tp) or _SCALARS.get(tp) or _CONVERTED.get(tp)
        if found is not None:
            return found
    if tp is typing.LiteralString:
        return _SCALARS[str]
    if isinstance(tp, TypeVar):
        return None
    if isinstance(tp, typing.NewType):
        return _compile(tp.__supertype__, ctx, depth + 1)
    if type(tp).__name__ == "TypeAliasType":  # `type X = ...` (Python 3.12)
        return _compile(tp.__value__, ctx, depth + 1)
    if _pydantic_type(tp):
        return _pydantic(tp, _label(tp))
    origin, args = get_origin(tp), get_args(tp)
    if origin is None and tp in (list, tuple, set, frozenset, dict):
        origin = tp
    if origin is typing.Annotated:
        if "pydantic" in sys.modules and _pydantic_metadata(tp.__metadata__):
            return _pydantic(tp, _label(args[0]))
        return _compile(args[0], ctx, depth + 1)
    if origin in (typing.Required, typing.NotRequired) or _named(origin, "ReadOnly"):
        return _compile(args[0], ctx, depth + 1)
    if origin is Union or origin is types.UnionType:
        members = [_compile(arg, ctx, depth + 1) for arg in args]
        if any(m is None for m in members):
            return None  # a member that takes any JSON value: the union does too
        return _union([m for m in members if m is not None])
    if origin is Literal:
        return _literal(args)
    if origin is list or _abc(origin, "Sequence", "MutableSequence", "Collection", "Iterable"):
        item = _compile(args[0], ctx, depth + 1) if args else None
        if origin is list:
            return _list(item, f"list[{item.label}]" if item is not None else "list")
        if item is not None and not item.plain:  # Sequence[X]: a list or a tuple, read as a list
            return _sequence(item, _label(tp), (list, tuple), list)
        return _list(item, _label(tp))
    if origin is tuple:
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            item = _compile(args[0], ctx, depth + 1) if args else None
            return _sequence(item or ANY, _label(tp) if args else "tuple", tuple, tuple)
        if args == ((),):  # tuple[()]
            return _tuple([], "tuple[()]")
        items = [_compile(arg, ctx, depth + 1) or ANY for arg in args]
        return _tuple(items, f"tuple[{', '.join(i.label for i in items)}]")
    if origin in (set, frozenset) or _abc(origin, "Set", "MutableSet"):
        build: type = frozenset if origin is frozenset else set
        item = _compile(args[0], ctx, depth + 1) if args else None
        label = _label(tp) if args else build.__name__
        if item is None or item.plain:
            return _plain_set(item or ANY, label, build)
        return _sequence(item, label, (set, frozenset), build)
    if origin is dict or _abc(origin, "Mapping", "MutableMapping"):
        if not args:
            return _dict(None, None, "dict")
        key = _key(args[0])
        value = _compile(args[1], ctx, depth + 1)
        label = f"dict[{key.label if key else _label(args[0])}, {value.label if value else 'Any'}]"
        return _dict(key, value, label)
    if is_typeddict(tp) or is_typeddict(origin):
        return _class(tp, ctx, depth, _typed_dict_of)
    cls = origin if isinstance(origin, type) else tp
    if isinstance(cls, type):
        if issubclass(cls, enum.Enum):
            return _enum(cls)
        if dataclasses.is_dataclass(cls):
            return _class(tp, ctx, depth, _dataclass_of)
        if issubclass(cls, tuple) and hasattr(cls, "_fields"):
            return _class(tp, ctx, depth, _named_tuple_of)
        if issubclass(cls, bytes):
            return _CONVERTED[bytes]
    if _pydantic_available():  # a type aioq has no form for: pydantic's, if it takes it
        return _pydantic(tp, _label(tp), fallback=True)
    return None


def _abc(origin: object, *names: str) -> bool:
    return any(origin is getattr(collections.abc, name) for name in names)


def _named(origin: object, name: str) -> bool:
    """Whether a special form is ``name`` (typing's or typing_extensions')."""
    return getattr(origin, "_name", None) == name


def _class(
    tp: Any,
    ctx: _Context,
    depth: int,
    make: Callable[[Any, list[_Field], _Context], Codec],
) -> Codec:
    """Compile a class of fields once per task (it may refer to itself, through a field)."""
    forward = _Forward()
    stand_in = Codec(_label(tp), forward.encode, forward.decode, fits=forward.fits)
    ctx.memo[tp] = stand_in
    fields = _fields(tp, ctx, depth)
    codec = make(tp, fields, ctx)
    forward.target = codec
    ctx.memo[tp] = codec
    return codec


def _fields(tp: Any, ctx: _Context, depth: int) -> list[_Field]:
    """The fields of a dataclass, NamedTuple or TypedDict, each with its codec and whether a
    value for it is required. Type variables of a generic class take the given arguments."""
    cls = get_origin(tp) or tp
    params = getattr(cls, "__parameters__", ())
    bound = dict(zip(params, get_args(tp), strict=False))
    module = sys.modules.get(cls.__module__)
    local = _Context(dict(vars(module)) if module else {}, ctx.memo, ctx.unresolved)
    try:
        hints = get_type_hints(cls, include_extras=True)
    except Exception:  # one unresolvable name: the others one by one
        hints = {}
        for klass in reversed(cls.__mro__):
            hints.update(getattr(klass, "__annotations__", {}))
    if dataclasses.is_dataclass(cls):
        found = [
            (f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
            if f.init
        ]
    elif is_typeddict(cls):
        # Required/NotRequired from the resolved hints: with `from __future__ import
        # annotations`, Python 3.11 cannot see them when it makes __required_keys__.
        found = [
            (name, _required(hints[name], name not in cls.__optional_keys__)) for name in hints
        ]
    else:  # a NamedTuple
        found = [(name, name not in cls._field_defaults) for name in cls._fields]
    fields = []
    for name, required in found:
        hint = _substitute(hints.get(name, Any), bound)
        fields.append(_Field(name, _compile(hint, local, depth + 1) or ANY, required))
    return fields


def _required(hint: Any, default: bool) -> bool:
    origin = get_origin(hint)
    while origin is typing.Annotated or _named(origin, "ReadOnly"):
        hint = get_args(hint)[0]
        origin = get_origin(hint)
    if origin is typing.NotRequired:
        return False
    return origin is typing.Required or default


def _substitute(hint: Any, bound: dict[Any, Any]) -> Any:
    """A field's annotation with the class's type variables replaced by its arguments."""
    if not bound:
        return hint
    if isinstance(hint, TypeVar):
        return bound.get(hint, Any)
    params = getattr(hint, "__parameters__", ())
    if params:
        try:
            return hint[tuple(bound.get(p, Any) for p in params)]
        except TypeError:
            return hint
    return hint


def _dataclass_of(tp: Any, fields: list[_Field], ctx: _Context) -> Codec:
    return _object_codec(_label(tp), fields, get_origin(tp) or tp, by_name=True)


def _named_tuple_of(tp: Any, fields: list[_Field], ctx: _Context) -> Codec:
    return _object_codec(_label(tp), fields, tp, by_name=False)


def _typed_dict_of(tp: Any, fields: list[_Field], ctx: _Context) -> Codec:
    return _typed_dict(_label(tp), fields)


# --- a task's arguments and result ---------------------------------------------------------------


def _annotations(
    fn: Callable[..., object], signature: inspect.Signature
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The function's annotations (resolved where they can be) and its module's names."""
    namespace = dict(getattr(fn, "__globals__", {}))
    try:
        return get_type_hints(fn, include_extras=True), namespace
    except Exception:
        pass
    # One unresolvable annotation: keep them as written, each resolved when compiled.
    found = {n: p.annotation for n, p in signature.parameters.items()}
    if signature.return_annotation is not inspect.Signature.empty:
        found["return"] = signature.return_annotation
    return {n: a for n, a in found.items() if a is not inspect.Parameter.empty}, namespace


class TaskCodec:
    """A task's compiled codecs: its arguments in and out of JSON, and its return value."""

    def __init__(
        self,
        task_name: str,
        named: list[tuple[str, Codec]],
        extra: Codec | None,
        declared: frozenset[str],
        result: Codec | None,
    ) -> None:
        self.task_name = task_name
        # Each parameter with a codec, and the exact types that need no look (as before: a
        # task of plain JSON parameters pays one `type(v) in fast` per argument).
        self.named = tuple((name, c.fast, c.encode, c.decode, c.plain) for name, c in named)
        self.extra = extra
        self.declared = declared
        self.result = result

    def encode(self, arguments: Mapping[str, object]) -> str:
        """Check and encode keyword arguments as stored JSON, or raise ArgumentError naming
        the argument and the path inside it (a SerializationError if it is not JSON)."""
        converted: dict[str, object] | None = None
        for name, fast, encode, _, plain in self.named:
            if name in arguments:
                value = arguments[name]
                if type(value) in fast:  # the common case, without a call
                    continue
                out = self._encode_one(encode, name, value)
                if not plain:
                    if converted is None:
                        converted = dict(arguments)
                    converted[name] = out
        extra = self.extra
        if extra is not None:
            for name, value in arguments.items():
                if name not in self.declared and type(value) not in extra.fast:
                    out = self._encode_one(extra.encode, name, value)
                    if not extra.plain:
                        if converted is None:
                            converted = dict(arguments)
                        converted[name] = out
        return encode_args(self.task_name, arguments if converted is None else converted)

    def _encode_one(self, encode: Encode, name: str, value: object) -> object:
        try:
            return encode(value)
        except _Mismatch as exc:
            path = exc.path(name)
            raise ArgumentError(
                self.task_name, f"argument {path!r} {exc.problem}", argument=path
            ) from None
        except Exception as exc:  # a class's own code (a property, __iter__) failed
            problem = f"argument {name!r} cannot be encoded: {type(exc).__name__}: {exc}"
            raise ArgumentError(self.task_name, problem, argument=name) from exc

    def decode(self, kwargs: dict[str, Any], job_id: int) -> dict[str, Any]:
        """Turn stored arguments (JSON, by name) into the annotated types, in place; raise
        PayloadError naming the argument and the path if one cannot be read as its type."""
        try:
            return self._decode(kwargs)
        except _Unreadable as exc:
            problem = f"cannot call {self.task_name!r} with its stored arguments: {exc.problem}"
            raise PayloadError(self.task_name, job_id, problem) from None

    def read(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Read arguments given in their JSON forms (``aioq defer --args``) into the annotated
        types; raise ArgumentError naming the argument and the path if one does not fit."""
        try:
            return self._decode(dict(values))
        except _Unreadable as exc:
            raise ArgumentError(self.task_name, exc.problem, argument=exc.path) from None

    def _decode(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        for name, fast, _, decode, _ in self.named:
            if name in kwargs:
                value = kwargs[name]
                if type(value) in fast:
                    continue
                kwargs[name] = _decode_one(decode, name, value)
        extra = self.extra
        if extra is not None:
            for name, value in list(kwargs.items()):
                if name not in self.declared and type(value) not in extra.fast:
                    kwargs[name] = _decode_one(extra.decode, name, value)
        return kwargs

    def encode_result(self, job_id: int, value: object) -> str:
        """Check and encode a return value, or raise ResultError saying what does not fit."""
        codec = self.result
        if codec is not None and type(value) not in codec.fast:
            try:
                value = codec.encode(value)
            except _Mismatch as exc:
                where = _result_path(exc)
                raise ResultError(
                    self.task_name, job_id, f"task {self.task_name!r}: {where} {exc.problem}"
                ) from None
            except Exception as exc:  # a class's own code failed
                problem = f"return value cannot be encoded: {type(exc).__name__}: {exc}"
                raise ResultError(
                    self.task_name, job_id, f"task {self.task_name!r}: {problem}"
                ) from exc
        return encode_result(self.task_name, job_id, value)

    def decode_result(self, value: Any, job_id: int) -> Any:
        """A stored return value (JSON) as the return annotation's type; ResultError if it
        cannot be read as one."""
        codec = self.result
        if codec is None or type(value) in codec.fast:
            return value
        try:
            return codec.decode(value)
        except _Mismatch as exc:
            where = _result_path(exc)
            problem = f"the stored {where} cannot be read: {exc.problem}"
        except Exception as exc:  # a class's own code, reading it, failed
            problem = f"the stored return value cannot be read: {type(exc).__name__}: {exc}"
        raise ResultError(self.task_name, job_id, f"task {self.task_name!r}: {problem}")


class _Unreadable(Exception):
    """An argument's stored JSON that cannot be read as its type: where, and why."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(problem)
        self.path = path
        self.problem = problem


def _decode_one(decode: Decode, name: str, value: object) -> object:
    try:
        return decode(value)
    except _Mismatch as exc:
        path = exc.path(name)
        raise _Unreadable(path, f"argument {path!r} {exc.problem}") from None
    except Exception as exc:  # a class's own code, reading it, failed
        problem = f"argument {name!r} cannot be read: {type(exc).__name__}: {exc}"
        raise _Unreadable(name, problem) from None


def _result_path(exc: _Mismatch) -> str:
    path = exc.path("").removeprefix(".")
    return f"return value at {path!r}" if path else "return value"


def compile_task(
    task_name: str, fn: Callable[..., object], signature: inspect.Signature
) -> tuple[TaskCodec, list[str]]:
    """Compile a task's codecs; return them and the annotations that did not resolve (their
    values pass as JSON)."""
    hints, namespace = _annotations(fn, signature)
    ctx = _Context(namespace)
    named: list[tuple[str, Codec]] = []
    extra: Codec | None = None
    for name, param in signature.parameters.items():
        codec = _guarded(hints, name, ctx)
        if codec is None:
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = codec
        else:
            named.append((name, codec))
    result = _guarded(hints, "return", ctx)
    values = TaskCodec(task_name, named, extra, frozenset(signature.parameters), result)
    return values, ctx.unresolved


def _guarded(hints: dict[str, Any], name: str, ctx: _Context) -> Codec | None:
    """The codec of one annotation; an annotation that fails to compile takes any JSON value
    (and is reported), as one that does not resolve."""
    if name not in hints:
        return None
    try:
        return _compile(hints[name], ctx, 0)
    except Exception as exc:
        ctx.unresolved.append(f"{name}: {hints[name]!r} ({type(exc).__name__}: {exc})")
        return None


def module_loading(fn: Callable[..., object]) -> bool:
    """Whether the module defining ``fn`` is still being imported (names below the task may
    not exist yet: its annotations are compiled again later)."""
    module = sys.modules.get(getattr(fn, "__module__", ""))
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


# --- the call itself: names --------------------------------------------------------------------


def explain_mismatch(
    signature: inspect.Signature, args: tuple[object, ...], kwargs: Mapping[str, object]
) -> str | None:
    """Name every unexpected, doubled and missing argument of a call that does not bind."""
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    positional = [
        p.name
        for p in params.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    problems = []
    if len(args) > len(positional):
        problems.append(f"{len(args)} positional arguments given, at most {len(positional)}")
    given_positionally = positional[: len(args)]
    doubled = [n for n in given_positionally if n in kwargs]
    if doubled:
        problems.append(f"{_names(doubled)} given twice (by position and by name)")
    unexpected = [] if takes_any else [n for n in kwargs if n not in params]
    if unexpected:
        problems.append(f"unexpected {_names(unexpected)}")
    given = set(given_positionally) | set(kwargs)
    missing = [
        p.name
        for p in params.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        and p.name not in given
    ]
    if missing:
        problems.append(f"missing required {_names(missing)}")
    if not problems:
        return None
    return "; ".join(problems) + f" (the task takes {_signature_text(signature)})"


_NAMES_SHOWN = 5  # a **kwargs-sized payload must not make a megabyte message


def _names(names: list[str]) -> str:
    word = "argument" if len(names) == 1 else "arguments"
    shown = ", ".join(repr(n[:40]) for n in names[:_NAMES_SHOWN])
    more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    return f"{word} {shown}{more}"


def _signature_text(signature: inspect.Signature) -> str:
    parts = []
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is inspect.Parameter.empty:
            parts.append(p.name)
        else:
            default = repr(p.default)
            parts.append(f"{p.name}={default if len(default) <= 20 else '...'}")
    return f"({', '.join(parts)})"
