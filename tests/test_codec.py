"""The codec's quick proof of a round trip says what the value-by-value walk says.

``encode_args`` and ``encode_result`` first try ``_encode_exact`` (a few C calls per nesting
level) and walk the value in Python only when that proof fails. These tests generate values of
every kind the walk refuses, and ones it accepts, and check that both ways end the same: the
same JSON text, or the same error with the same message. No database: the round trip through
jsonb itself is tested in test_defer.py.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import uuid
from collections import OrderedDict
from datetime import UTC
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aioq
from aioq import codec


class Colour(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    LOW = 1


class Mode(enum.StrEnum):
    FAST = "fast"


class Weight(float, enum.Enum):
    LIGHT = 1.5


class Text(str):
    pass


class Number(int):
    pass


class Real(float):
    pass


class Items(list[object]):
    pass


@dataclasses.dataclass
class Point:
    x: int


_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=8)
# Values the walk accepts, in text the quick proof reads without doubt (no "e+", no backslash).
_plain_text = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="\x00\\+"), max_size=8
)
_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(-9e15, 9e15, allow_nan=False)
    | _plain_text,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_plain_text, kids, max_size=4),
    max_leaves=25,
)
plain_kwargs = st.dictionaries(_plain_text, _plain, max_size=5)

# Anything: each kind the walk refuses, near misses it accepts, and text that looks like both.
_edges = st.sampled_from(
    [
        2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30,
        1e16, -1e16, 9.999999999999998e15, 2.0**63, 2.0**64, 1e20, 1e300, 5e-324, 1e-7, -0.0,
        math.nan, math.inf, -math.inf, "\x00", "\ud800", "a\x00b", "\\u0000", "1e+16", "e+",
        "null", Colour.RED, Level.LOW, Mode.FAST, Weight.LIGHT, Text("t"), Number(1),
        Real(1.5), Items([1]), OrderedDict(a=1), Point(1), orjson.Fragment(b"[1]"), object(),
        {1, 2}, frozenset({1}), b"bytes", bytearray(b"b"), 1j, Ellipsis,
    ]
)  # fmt: skip
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | _edges
    | st.text(st.characters() | st.sampled_from(["\x00", "\ud800", "\\", "+", "e"]), max_size=8)
    | st.datetimes(timezones=st.none() | st.just(UTC))
    | st.dates()
    | st.uuids()
    | st.decimals(allow_nan=True)
)
_any = st.recursive(
    _scalars,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.tuples(kids, kids)
        | st.dictionaries(_text | st.integers() | st.just(Text("k")), kids, max_size=4)
    ),
    max_leaves=20,
)
any_kwargs = st.dictionaries(_text | st.sampled_from(["\x00", "\ud800"]), _any, max_size=4)


def outcome(encode: Any, *args: object) -> tuple[str, str]:
    """What an encoding did: ("ok", the text) or (the error's type, its message)."""
    try:
        return "ok", encode(*args)
    except aioq.AioqError as exc:
        return type(exc).__name__, str(exc)


def nested(depth: int, container: type) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value] if container is list else {"k": value}
    return value


@settings(max_examples=400, deadline=None)
@given(any_kwargs)
def test_encode_args_ends_as_the_walk_does(kwargs: dict[str, object]) -> None:
    slow = outcome(codec._encode_args_checked, "t", kwargs)
    assert outcome(codec.encode_args, "t", kwargs) == slow
    if codec._encode_exact(kwargs, list(kwargs.values())) is not None:
        assert slow[0] == "ok"


@settings(max_examples=400, deadline=None)
@given(_any)
def test_encode_result_ends_as_the_walk_does(value: object) -> None:
    slow = outcome(codec._encode_result_checked, "t", 1, value)
    assert outcome(codec.encode_result, "t", 1, value) == slow
    if codec._encode_exact(value, [value]) is not None:
        assert slow[0] == "ok"


@settings(max_examples=200, deadline=None)
@given(plain_kwargs)
def test_plain_json_takes_the_quick_proof(kwargs: dict[str, object]) -> None:
    encoded = codec._encode_exact(kwargs, list(kwargs.values()))
    assert encoded is not None
    assert encoded.decode() == codec._encode_args_checked("t", kwargs)
    assert codec._encode_exact(kwargs, [kwargs]) is not None  # the same as a return value


@pytest.mark.parametrize("container", [list, dict])
@pytest.mark.parametrize("depth", [199, 200, 201, 202, 253, 254, 255, 300])
def test_nesting_limit_is_the_walks(depth: int, container: type) -> None:
    kwargs = {"deep": nested(depth, container)}
    slow = outcome(codec._encode_args_checked, "t", kwargs)
    assert outcome(codec.encode_args, "t", kwargs) == slow
    assert (slow[0] == "ok") == (depth <= 201)  # the outermost container is at depth 0
    value = nested(depth, container)
    assert outcome(codec.encode_result, "t", 1, value) == outcome(
        codec._encode_result_checked, "t", 1, value
    )


@pytest.mark.parametrize(
    "value",
    [Level.LOW, Mode.FAST, Weight.LIGHT, uuid.UUID(int=1), (1,), math.nan, math.inf, 1e16],
    ids=["intenum", "strenum", "float-enum", "uuid", "tuple", "nan", "inf", "1e16"],
)
def test_values_orjson_encodes_but_jsonb_would_change_are_refused(value: object) -> None:
    """orjson encodes each of these (the enums even compare equal to what comes back)."""
    orjson.dumps(value)
    with pytest.raises(aioq.errors.SerializationError) as info:
        codec.encode_args("t", {"x": [None, {"y": value}]})
    assert info.value.argument == "x[1]['y']"
    with pytest.raises(aioq.errors.ResultError):
        codec.encode_result("t", 1, {"y": [value]})
