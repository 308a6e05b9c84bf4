"""Python values in, Python values out: a task's annotations are the schema of its arguments
and its result (docs/tasks.md, "Argument and result types"; docs/architecture.md, "Values").

The codec alone first (every type and its JSON form, the unions' rules, what is refused and
how it is named), then through real PostgreSQL and real workers: defer, defer_many, call,
defer_sync and raw SQL in; instances out in async and plain def tasks; results typed by
``task.result``, ``upstream()`` and ``aioq.workflow``; stored values that cannot be read.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, NotRequired, TypedDict
from zoneinfo import ZoneInfo

import anyio
import asyncpg
import orjson
import psycopg
import pydantic
import pytest
from waits import eventually

import aioq
import aioq.testing
from aioq.codec import encode_args
from aioq.errors import PayloadError, ResultError
from aioq.values import ANY, compile_annotation, duration_text

pytestmark = pytest.mark.anyio

HANG_GUARD = 60.0
TYPING = Path(__file__).parent / "typing"
ROOT = Path(__file__).parent.parent  # the checkout whose aioq the subprocesses import


# --- the types of the tests (module level: annotations resolve in this module) ----------------


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mode(enum.StrEnum):
    FAST = "fast"
    SAFE = "safe"


class Perm(enum.IntFlag):
    READ = 1
    WRITE = 2


@dataclass(frozen=True, slots=True)
class Line:
    sku: str
    qty: int = 1
    price: Decimal = Decimal("0")


@dataclass
class Address:
    street: str
    city: str
    zip: str | None = None


@dataclass(kw_only=True)
class Order:
    id: uuid.UUID
    lines: list[Line]
    ship_to: Address
    due: date
    placed: datetime
    tags: set[str] = field(default_factory=set)
    notes: dict[int, Color] = field(default_factory=dict)
    parent: Order | None = None  # a dataclass that refers to itself


class Point(NamedTuple):
    x: int
    y: int = 0


class Parcel(TypedDict):
    weight: float
    sent: datetime
    note: NotRequired[str]


class Invoice(pydantic.BaseModel):
    number: int
    customer: uuid.UUID
    total: Decimal
    due: date
    lines: list[Line]
    status: Color = Color.RED


@pydantic.dataclasses.dataclass
class Stamp:
    at: datetime
    by: str


ORDER = Order(
    id=uuid.UUID("12345678-1234-5678-1234-567812345678"),
    lines=[Line("A-1", 2, Decimal("9.95")), Line("B-2")],
    ship_to=Address("1 Rue de la Paix", "Paris"),
    due=date(2026, 12, 31),
    placed=datetime(2026, 5, 1, 12, 30, tzinfo=ZoneInfo("Europe/Paris")),
    tags={"gift"},
    notes={3: Color.GREEN},
    parent=Order(
        id=uuid.UUID(int=1),
        lines=[],
        ship_to=Address("2 Main St", "Boston", "02108"),
        due=date(2026, 1, 1),
        placed=datetime(2026, 1, 1, 9, 0),
    ),
)
ORDER_JSON = {
    "id": "12345678-1234-5678-1234-567812345678",
    "lines": [
        {"sku": "A-1", "qty": 2, "price": "9.95"},
        {"sku": "B-2", "qty": 1, "price": "0"},
    ],
    "ship_to": {"street": "1 Rue de la Paix", "city": "Paris", "zip": None},
    "due": "2026-12-31",
    "placed": "2026-05-01T12:30:00+02:00",
    "tags": ["gift"],
    "notes": {"3": "green"},
    "parent": {
        "id": "00000000-0000-0000-0000-000000000001",
        "lines": [],
        "ship_to": {"street": "2 Main St", "city": "Boston", "zip": "02108"},
        "due": "2026-01-01",
        "placed": "2026-01-01T09:00:00",
        "tags": [],
        "notes": {},
        "parent": None,
    },
}
INVOICE = Invoice(
    number=7,
    customer=uuid.UUID(int=7),
    total=Decimal("1234.50"),
    due=date(2026, 6, 30),
    lines=[Line("C-3", 1, Decimal("1234.50"))],
)

# (annotation, value, its JSON form): the table of docs/tasks.md, value by value.
FORMS: list[tuple[Any, object, object]] = [
    (int, 7, 7),
    (float, 2.5, 2.5),
    (str, "é", "é"),
    (bool, True, True),
    (None, None, None),
    (datetime, datetime(2026, 5, 1, 12, 30, 15, 250), "2026-05-01T12:30:15.000250"),
    (datetime, datetime(2026, 5, 1, 12, 30, tzinfo=UTC), "2026-05-01T12:30:00+00:00"),
    (
        datetime,
        datetime(2026, 5, 1, 12, 30, tzinfo=timezone(timedelta(hours=5, minutes=30))),
        "2026-05-01T12:30:00+05:30",
    ),
    (date, date(2026, 12, 31), "2026-12-31"),
    (time, time(9, 5), "09:05:00"),
    (time, time(9, 5, 1, 5, tzinfo=timezone(-timedelta(hours=3))), "09:05:01.000005-03:00"),
    (timedelta, timedelta(days=1, hours=2, minutes=3, seconds=4.5), "P1DT2H3M4.5S"),
    (timedelta, timedelta(seconds=-1), "-PT1S"),
    (timedelta, timedelta(0), "PT0S"),
    (timedelta, timedelta(days=400, microseconds=1), "P400DT0.000001S"),
    (uuid.UUID, uuid.UUID(int=255), "00000000-0000-0000-0000-0000000000ff"),
    (Decimal, Decimal("12.50"), "12.50"),
    (Decimal, Decimal("-1E+30"), "-1E+30"),
    (Decimal, Decimal("0.1000000000000000000001"), "0.1000000000000000000001"),
    (Color, Color.GREEN, "green"),
    (Level, Level.HIGH, 2),
    (Mode, Mode.SAFE, "safe"),
    (Perm, Perm.READ | Perm.WRITE, 3),
    (bytes, b"\x00\xffabc", "AP9hYmM="),
    (tuple[int, str], (1, "a"), [1, "a"]),
    (tuple[Decimal, ...], (Decimal("1.5"), Decimal("2")), ["1.5", "2"]),
    (tuple[()], (), []),
    (set[uuid.UUID], {uuid.UUID(int=1)}, ["00000000-0000-0000-0000-000000000001"]),
    (frozenset[int], frozenset({5}), [5]),
    (list[date], [date(2026, 1, 1)], ["2026-01-01"]),
    (list[int], [1, 2], [1, 2]),
    (dict[str, Decimal], {"a": Decimal("1")}, {"a": "1"}),
    (dict[int, str], {1: "a", -2: "b"}, {"1": "a", "-2": "b"}),
    (dict[uuid.UUID, int], {uuid.UUID(int=2): 1}, {"00000000-0000-0000-0000-000000000002": 1}),
    (dict[Color, int], {Color.RED: 1}, {"red": 1}),
    (dict[Level, int], {Level.LOW: 5}, {"1": 5}),
    (Literal["a", 1, Color.RED], Color.RED, "red"),
    (Literal["a", 1, Color.RED], 1, 1),
    (uuid.UUID | None, None, None),
    (uuid.UUID | None, uuid.UUID(int=3), "00000000-0000-0000-0000-000000000003"),
    (int | datetime, datetime(2026, 1, 1), "2026-01-01T00:00:00"),
    (int | datetime, 4, 4),
    (Annotated[date, "the due day"], date(2026, 2, 2), "2026-02-02"),
    (Line, Line("X", 3, Decimal("0.10")), {"sku": "X", "qty": 3, "price": "0.10"}),
    (Order, ORDER, ORDER_JSON),
    (Point, Point(1, 2), {"x": 1, "y": 2}),
    (
        Parcel,
        {"weight": 1.5, "sent": datetime(2026, 1, 1, tzinfo=UTC)},
        {"weight": 1.5, "sent": "2026-01-01T00:00:00+00:00"},
    ),
    (list[Line | None], [None, Line("Y")], [None, {"sku": "Y", "qty": 1, "price": "0"}]),
    (
        Invoice,
        INVOICE,
        {
            "number": 7,
            "customer": "00000000-0000-0000-0000-000000000007",
            "total": "1234.50",
            "due": "2026-06-30",
            "lines": [{"sku": "C-3", "qty": 1, "price": "1234.50"}],
            "status": "red",
        },
    ),
    (Stamp, Stamp(datetime(2026, 3, 3), "ada"), {"at": "2026-03-03T00:00:00", "by": "ada"}),
    (Annotated[int, pydantic.Field(gt=0)], 5, 5),
]


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (and the same UTC offsets)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, datetime | time) and a.utcoffset() != b.utcoffset():
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, pydantic.BaseModel):
        return all(same(getattr(a, f), getattr(b, f)) for f in type(a).model_fields)
    return bool(a == b)


@pytest.mark.parametrize(("tp", "value", "form"), FORMS, ids=lambda x: "")
def test_each_type_is_stored_in_its_json_form_and_read_back_as_itself(
    tp: Any, value: object, form: object
) -> None:
    codec = compile_annotation(tp, globals())
    stored = orjson.loads(encode_args("t", {"x": codec.encode(value)}))["x"]
    assert stored == form
    back = codec.decode(stored)
    assert same(back, value), (back, value)


def test_an_aware_datetime_keeps_its_instant_and_offset_not_its_zone() -> None:
    codec = compile_annotation(datetime)
    paris = datetime(2026, 7, 1, 12, tzinfo=ZoneInfo("Europe/Paris"))
    back = codec.decode(codec.encode(paris))
    assert back == paris
    assert back.utcoffset() == timedelta(hours=2)
    assert back.tzinfo == timezone(timedelta(hours=2))
    naive = codec.decode(codec.encode(datetime(2026, 7, 1, 12)))
    assert naive.tzinfo is None


@pytest.mark.parametrize(
    ("tp", "form", "value"),
    [
        (datetime, "2026-05-01T12:30:00Z", datetime(2026, 5, 1, 12, 30, tzinfo=UTC)),
        (time, "12:30Z", time(12, 30, tzinfo=UTC)),
        (timedelta, 90, timedelta(seconds=90)),
        (timedelta, 1.5, timedelta(seconds=1.5)),
        (timedelta, "PT1H30M", timedelta(hours=1, minutes=30)),
        (timedelta, "P1W", timedelta(days=7)),
        (timedelta, "P1Y35D", timedelta(days=400)),  # pydantic writes years of 365 days
        (timedelta, "-P1DT0.5S", -timedelta(days=1, seconds=0.5)),
        (Decimal, 12, Decimal(12)),
        (Decimal, "1e3", Decimal("1e3")),
        (uuid.UUID, "12345678123456781234567812345678", uuid.UUID(hex="12345678" * 4)),
        (uuid.UUID, "{12345678-1234-5678-1234-567812345678}", ORDER.id),
        (float, 3, 3),  # an int where a float is annotated: as Python's typing allows
        (Line, {"sku": "Z"}, Line("Z")),  # a field the JSON lacks takes its default
    ],
    ids=lambda x: "",
)
def test_the_decoder_reads_other_writers_forms(tp: Any, form: object, value: object) -> None:
    assert same(compile_annotation(tp, globals()).decode(form), value)


# --- what does not fit, and how it is named ------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "value", "message"),
    [
        (uuid.UUID, "12345678-1234-5678-1234-567812345678", "must be UUID, got str"),
        (date, datetime(2026, 1, 1), "must be date, got datetime"),
        (Decimal, 1.5, "must be Decimal, got float 1.5"),
        (Color, "red", "must be Color, got str 'red'"),
        (Literal["a", "b"], "c", "must be Literal['a', 'b'], got str 'c'"),
        (Literal[1], True, "must be Literal[1], got bool True"),
        (tuple[int, int], (1,), "must be tuple[int, int], got tuple (1,)"),
        (list[Line], [Line("a"), Line(7)], "[1].sku' must be str, got int 7"),  # type: ignore[arg-type]
        (Order, dataclasses.replace(ORDER, lines=[Line("a", "2")]), "lines[0].qty' must be int"),  # type: ignore[arg-type]
        (dict[int, str], {"1": "a"}, "has the key '1', which must be int, got str '1'"),
        (Parcel, {"weight": 1.0}, "lacks the key 'sent', which Parcel requires"),
        (Parcel, {"weight": 1.0, "sent": datetime(2026, 1, 1), "x": 1}, "key 'x', which Parcel"),
        (int | uuid.UUID, "x", "must be int | UUID, got str 'x'"),
        (Invoice, {"number": 1}, "must be Invoice, got dict"),
        (Annotated[int, pydantic.Field(gt=0)], 0, "greater than 0 (pydantic), got 0"),
        (Stamp, {"at": "x"}, "is invalid: input should be an instance of Stamp"),
    ],
    ids=lambda x: "",
)
def test_a_value_that_does_not_fit_is_refused_with_its_path(
    registry: aioq.Registry, tp: Any, value: object, message: str
) -> None:
    def fn(arg: Any) -> None: ...

    fn.__annotations__ = {"arg": tp}
    task = registry.task(fn)
    with pytest.raises(aioq.ArgumentError) as info:
        task.encode({"arg": value})
    assert message in str(info.value)
    assert repr(task.name) in str(info.value)
    assert info.value.argument is not None
    assert info.value.argument.startswith("arg")


def test_the_path_runs_through_lists_fields_and_keys(registry: aioq.Registry) -> None:
    @registry.task
    def ship(orders: list[Order], by_city: dict[str, list[Line]]) -> None: ...

    bad = dataclasses.replace(ORDER, lines=[*ORDER.lines, *ORDER.lines, Line(7)])  # type: ignore[arg-type]
    with pytest.raises(aioq.ArgumentError) as info:
        ship.encode({"orders": [ORDER, bad], "by_city": {}})
    assert str(info.value) == (
        f"cannot defer {ship.name!r}: argument 'orders[1].lines[4].sku' must be str, got int 7"
    )
    assert info.value.argument == "orders[1].lines[4].sku"
    with pytest.raises(aioq.ArgumentError, match=r"argument \"by_city\['Paris'\]\[0\]\" must be"):
        ship.encode({"orders": [], "by_city": {"Paris": [{"sku": "a"}]}})


@pytest.mark.parametrize(
    ("tp", "stored", "message"),
    [
        (date, "tomorrow", "'x' must be date (ISO 8601 text), got str 'tomorrow'"),
        (uuid.UUID, "nope", "must be UUID (a UUID string), got str 'nope'"),
        (Decimal, 0.1, 'must be Decimal as a string ("0.1"), got the JSON number 0.1'),
        (Decimal, "ten", "must be Decimal (a decimal number as a string), got str 'ten'"),
        (timedelta, "P1X", "must be timedelta (an ISO 8601 duration, or seconds)"),
        (bytes, "not base64!", "must be bytes (base64 text)"),
        (Color, "blue", "must be a value of Color ('red', 'green'), got 'blue'"),
        (Level, "1", "must be a value of Level (1, 2), got '1'"),
        (tuple[int, int], [1, 2, 3], "must be tuple[int, int] (a JSON array of 2)"),
        (Line, {"qty": 1}, "'x' lacks the field 'sku', which Line requires"),
        (Order, {**ORDER_JSON, "due": "2026-02-30"}, "'x.due' must be date"),
        (list[Line], [{"sku": 5}], "'x[0].sku' must be str, got int 5"),
        (dict[int, int], {"1.5": 1}, "has the key '1.5', which must be an integer key"),
        (Invoice, {"number": "x"}, "'x.number' is invalid: input should be a valid integer"),
        (int, "7", "'x' must be int, got str '7'"),
    ],
    ids=lambda x: "",
)
def test_a_stored_value_that_cannot_be_read_is_a_payload_error_naming_the_path(
    registry: aioq.Registry, tp: Any, stored: object, message: str
) -> None:
    def fn(x: Any) -> None: ...

    fn.__annotations__ = {"x": tp}
    task = registry.task(fn)
    with pytest.raises(PayloadError) as info:
        task.codec.decode({"x": stored}, 41)
    assert message in str(info.value), str(info.value)
    assert (info.value.task_name, info.value.job_id) == (task.name, 41)


def test_serialization_error_is_an_argument_error() -> None:
    # One error to catch at defer; the old name still catches what it caught.
    assert issubclass(aioq.errors.SerializationError, aioq.ArgumentError)
    error = aioq.errors.SerializationError("t", "x[1]", "is nan")
    assert (error.task_name, error.argument) == ("t", "x[1]")


@dataclass
class Checked:
    n: int
    when: datetime | None = None

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must not be negative")


@dataclass(frozen=True)
class SubLine(Line):
    extra: str = "x"


@pytest.mark.parametrize(
    ("tp", "value"),
    [
        (Order, ORDER),
        (Line, Line("a", 2, Decimal("1"))),
        (Line, SubLine("a")),  # a subclass: the annotated class's fields
        (Line, Line(7)),  # type: ignore[arg-type]
        (Line, {"sku": "a"}),
        (Point, Point(1)),
        (Point, (1, 2)),
        (Checked, Checked(1, datetime(2026, 1, 1))),
    ],
    ids=lambda x: "",
)
def test_the_compiled_code_of_a_class_writes_what_the_generic_code_writes(
    tp: Any, value: object
) -> None:
    codec = compile_annotation(tp, globals())
    generic = codec.encode.__globals__["slow_encode"]  # the code the compiled one stands for
    assert outcome(codec.encode, value) == outcome(generic, value)


@pytest.mark.parametrize(
    ("tp", "stored"),
    [
        (Order, ORDER_JSON),
        (Order, {**ORDER_JSON, "tags": ["a"], "extra": 1}),
        (Order, {**ORDER_JSON, "due": "2026-02-30"}),
        (Line, {"sku": "a"}),  # a default taken
        (Line, {"sku": "a", "qty": "2"}),
        (Line, {"sku": "a", "price": "x"}),
        (Line, ["a"]),
        (Point, {"x": 1, "y": 2}),
        (Checked, {"n": -1}),  # __post_init__ refuses
        (Checked, {"n": 1, "when": "2026-01-01T00:00:00"}),
    ],
    ids=lambda x: "",
)
def test_the_compiled_code_of_a_class_reads_what_the_generic_code_reads(
    tp: Any, stored: object
) -> None:
    codec = compile_annotation(tp, globals())
    generic = codec.decode.__globals__["slow_decode"]
    assert outcome(codec.decode, stored) == outcome(generic, stored)


def outcome(fn: Callable[[Any], Any], value: object) -> tuple[str, object]:
    """What a codec function returned, or the _Mismatch it raised (its path and problem)."""
    from aioq.values import _Mismatch

    try:
        return ("value", fn(value))
    except _Mismatch as exc:
        return ("mismatch", (exc.path(""), exc.problem))


# --- unions ------------------------------------------------------------------------------------


@dataclass
class Cat:
    name: str


@dataclass
class Dog:
    name: str
    good: bool = True


@dataclass
class Bird:
    name: str
    wings: int


def test_a_union_encodes_by_the_first_member_the_value_fits_by_type() -> None:
    codec = compile_annotation(int | float | Decimal | str)
    assert codec.encode(1) == 1
    assert codec.encode(1.5) == 1.5
    assert codec.encode(Decimal("1.5")) == "1.5"
    for value in (b"x", True):  # a bool is no int here: exact types, as JSON keeps them
        with pytest.raises(Exception, match=r"must be int \| float \| Decimal \| str, got"):
            codec.encode(value)


def test_a_union_decodes_plain_json_types_first_then_in_the_order_written() -> None:
    # A JSON string is a str before it is a UUID, whatever the order written.
    for tp in (uuid.UUID | str, str | uuid.UUID):
        codec = compile_annotation(tp)
        assert codec.decode("00000000-0000-0000-0000-000000000001") == (
            "00000000-0000-0000-0000-000000000001"
        )
    # Without a str member, the string is read as the first member that takes it.
    codec = compile_annotation(int | uuid.UUID | date)
    assert codec.decode("2026-01-01") == date(2026, 1, 1)
    assert codec.decode(str(uuid.UUID(int=9))) == uuid.UUID(int=9)
    assert codec.decode(3) == 3


def test_a_union_of_dataclasses_prefers_the_member_with_every_key() -> None:
    codec = compile_annotation(Cat | Dog | Bird, globals())
    for pet in (Cat("tom"), Dog("rex", good=False), Bird("tweety", 2)):
        assert same(codec.decode(codec.encode(pet)), pet)


# --- plain JSON annotations keep the fast path -------------------------------------------------


def test_plain_annotations_store_and_read_their_values_as_they_are(
    registry: aioq.Registry,
) -> None:
    class Meta(TypedDict):
        a: int
        tags: list[str]

    @registry.task
    def plain(n: int, f: float, s: str, b: bool, ids: list[int], meta: dict[str, Any]) -> None: ...

    args = {"n": 1, "f": 1.5, "s": "x", "b": True, "ids": [1, 2], "meta": {"k": [1]}}
    assert plain.encode(args) == encode_args(plain.name, args)  # the same JSON, the same way
    for name, tp in plain.fn.__annotations__.items():
        if name != "return":
            assert compile_annotation(eval(tp)).plain, name
    stored = orjson.loads(plain.encode(args))
    kwargs = plain.codec.decode(stored, 1)
    assert kwargs is stored
    assert kwargs["ids"] is stored["ids"]
    assert compile_annotation(Meta).plain
    assert compile_annotation(Any) is ANY
    assert compile_annotation(object) is ANY


def test_an_argument_of_any_or_no_annotation_is_json_as_before(registry: aioq.Registry) -> None:
    @registry.task
    def loose(a, b: Any, c: object) -> None: ...  # type: ignore[no-untyped-def]

    with pytest.raises(aioq.errors.SerializationError, match="has type UUID, which is not JSON"):
        loose.encode({"a": uuid.UUID(int=1), "b": 1, "c": 1})
    stored = orjson.loads(loose.encode({"a": {"x": 1}, "b": [1], "c": "s"}))
    assert loose.codec.decode(stored, 1) == {"a": {"x": 1}, "b": [1], "c": "s"}


# --- evolution: a payload class changes while jobs of the old shape wait -----------------------


@dataclass
class Welcome:
    user: str
    locale: str = "en"  # added since the job was deferred, with a default


class WelcomeTD(TypedDict):
    user: str
    locale: NotRequired[str]


class WelcomeNT(NamedTuple):
    user: str
    locale: str = "en"


class WelcomeModel(pydantic.BaseModel):
    user: str
    locale: str = "en"


@pytest.mark.parametrize("tp", [Welcome, WelcomeTD, WelcomeNT, WelcomeModel], ids=lambda x: "")
def test_old_jobs_read_after_a_field_is_added_with_a_default_and_another_dropped(
    tp: Any,
) -> None:
    old = {"user": "ada", "theme": "dark"}  # theme: a field the class no longer has
    back = compile_annotation(tp, globals()).decode(old)
    if tp is WelcomeTD:
        assert back == {"user": "ada"}
    else:
        assert (back.user, back.locale) == ("ada", "en")


def test_a_field_added_without_a_default_makes_old_jobs_unreadable(
    registry: aioq.Registry,
) -> None:
    @registry.task
    def welcome(w: Line) -> None: ...

    with pytest.raises(PayloadError, match="argument 'w' lacks the field 'sku', which Line"):
        welcome.codec.decode({"w": {"qty": 1}}, 1)


# --- results ---------------------------------------------------------------------------------


def test_a_return_value_that_does_not_fit_fails_with_a_result_error(
    registry: aioq.Registry,
) -> None:
    @registry.task(result_ttl=60)
    def total() -> Decimal:
        return Decimal(1)

    assert total.codec.encode_result(1, Decimal("1.10")) == '"1.10"'
    with pytest.raises(ResultError, match=r"return value must be Decimal, got float 1\.1"):
        total.codec.encode_result(1, 1.1)

    @registry.task(result_ttl=60)
    def lines() -> list[Line]:
        return []

    with pytest.raises(ResultError, match=r"return value at '\[0\].qty' must be int, got str"):
        lines.codec.encode_result(1, [Line("a", "2")])  # type: ignore[arg-type]


# --- through PostgreSQL and a worker ----------------------------------------------------------


@dataclass
class Seen:
    """What each run received, by job id."""

    values: dict[int, dict[str, Any]] = field(default_factory=dict)


KITCHEN: dict[str, Any] = {
    "order": ORDER,
    "when": datetime(2026, 5, 1, 8, tzinfo=timezone(timedelta(hours=-4))),
    "naive": datetime(2026, 5, 1, 8, 0, 0, 123456),
    "every": timedelta(minutes=90),
    "at": time(23, 59, 59),
    "amount": Decimal("0.10"),
    "level": Level.HIGH,
    "mode": Mode.FAST,
    "blob": b"\x00\x01\xfe",
    "pair": (3, "three"),
    "many": (Decimal("1"), Decimal("2.5")),
    "ids": frozenset({uuid.UUID(int=5), uuid.UUID(int=6)}),
    "kind": "a",
    "maybe": None,
    "point": Point(4),
    "parcel": {"weight": 2.0, "sent": datetime(2026, 1, 2, tzinfo=UTC), "note": "fragile"},
    "invoice": INVOICE,
    "by_level": {Level.LOW: [Line("L")]},
}


def kitchen_sink(registry: aioq.Registry, seen: Seen, *, sync: bool) -> aioq.Task[..., Any]:
    """A task of every type, async or plain def; it records what it received."""

    def record(**values: Any) -> Line:
        seen.values[aioq.current_job().id] = values
        first: Line = values["order"].lines[0]
        return first

    if sync:

        @registry.task(name="values.sink_sync", result_ttl=60)
        def sink_sync(
            order: Order, when: datetime, naive: datetime, every: timedelta, at: time,
            amount: Decimal, level: Level, mode: Mode, blob: bytes, pair: tuple[int, str],
            many: tuple[Decimal, ...], ids: frozenset[uuid.UUID], kind: Literal["a", "b"],
            maybe: uuid.UUID | None, point: Point, parcel: Parcel, invoice: Invoice,
            by_level: dict[Level, list[Line]],
        ) -> Line:  # fmt: skip
            return record(**{k: v for k, v in locals().items() if k in KITCHEN})

        return sink_sync

    @registry.task(name="values.sink", result_ttl=60)
    async def sink(
        order: Order, when: datetime, naive: datetime, every: timedelta, at: time,
        amount: Decimal, level: Level, mode: Mode, blob: bytes, pair: tuple[int, str],
        many: tuple[Decimal, ...], ids: frozenset[uuid.UUID], kind: Literal["a", "b"],
        maybe: uuid.UUID | None, point: Point, parcel: Parcel, invoice: Invoice,
        by_level: dict[Level, list[Line]],
    ) -> Line:  # fmt: skip
        return record(**{k: v for k, v in locals().items() if k in KITCHEN})

    return sink


@pytest.mark.parametrize("sync", [False, True], ids=["async", "def"])
async def test_every_type_reaches_the_task_as_itself_from_every_way_in(
    conn: asyncpg.Connection,
    dsn: str,
    registry: aioq.Registry,
    make_worker: Callable[..., aioq.Worker],
    sync: bool,
) -> None:
    seen = Seen()
    task = kitchen_sink(registry, seen, sync=sync)
    ids = [await task.defer(conn, **KITCHEN)]
    ids += await task.defer_many(conn, [KITCHEN, KITCHEN])

    def from_sync_code() -> int:
        with psycopg.connect(dsn) as sync_conn:
            return task.defer_sync(sync_conn, **KITCHEN)

    ids.append(await anyio.to_thread.run_sync(from_sync_code))
    flow = aioq.Workflow("kitchen")
    flow.add(task.call(**KITCHEN), name="sink")
    run = await flow.defer(conn)
    ids.append(run.jobs["sink"])
    # The same JSON, written by hand (raw SQL, another language): the documented forms.
    stored = await conn.fetchval("SELECT args::text FROM aioq.jobs WHERE id = $1", ids[0])
    raw = await conn.fetchval(
        "INSERT INTO aioq.jobs (task, args) VALUES ($1, $2::jsonb) RETURNING id", task.name, stored
    )
    ids.append(raw)
    assert orjson.loads(stored)["order"] == ORDER_JSON
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()
    assert sorted(seen.values) == sorted(ids)
    for job_id in ids:
        got = seen.values[job_id]
        assert same(got, KITCHEN), job_id
        assert isinstance(got["order"].lines[0], Line)
        assert isinstance(got["order"].parent.ship_to, Address)
        assert isinstance(got["invoice"].lines[0], Line)
    value = await task.result(conn, ids[0], timeout=HANG_GUARD)
    assert value == Line("A-1", 2, Decimal("9.95"))
    assert type(value.price) is Decimal
    assert await aioq.result(conn, ids[0]) == {"sku": "A-1", "qty": 2, "price": "9.95"}


async def test_a_job_written_by_raw_sql_in_the_documented_forms_runs_with_instances(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    got: list[tuple[Order, timedelta, Decimal, Color]] = []

    @registry.task(name="values.raw")
    async def raw(order: Order, every: timedelta, amount: Decimal, color: Color) -> None:
        got.append((order, every, amount, color))

    # Other writers' forms: a Z offset, seconds for a duration, an integer Decimal.
    doc = {**ORDER_JSON, "placed": "2026-05-01T10:30:00Z", "unknown": 1}
    await conn.execute(
        "INSERT INTO aioq.jobs (task, args) VALUES ('values.raw', jsonb_build_object("
        "'order', $1::jsonb, 'every', 5400, 'amount', 12, 'color', 'green'))",
        orjson.dumps(doc).decode(),
    )
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()
    [(order, every, amount, color)] = got
    assert order.placed == ORDER.placed
    assert order.placed.utcoffset() == timedelta(0)
    assert same(dataclasses.replace(order, placed=ORDER.placed), ORDER)
    assert (every, amount, color) == (timedelta(minutes=90), Decimal(12), Color.GREEN)


async def test_a_value_that_does_not_fit_writes_nothing_and_leaves_the_transaction_usable(
    conn: asyncpg.Connection, dsn: str, registry: aioq.Registry
) -> None:
    @registry.task
    def ship(order: Order, due: date) -> None: ...

    bad = dataclasses.replace(ORDER, lines=[Line("a"), Line("b"), Line("c"), Line(7)])  # type: ignore[arg-type]
    message = "argument 'order.lines[3].sku' must be str, got int 7"
    async with conn.transaction():
        await ship.defer(conn, order=ORDER, due=date(2026, 1, 1))
        with pytest.raises(aioq.ArgumentError, match=re.escape(message)):
            await ship.defer(conn, order=bad, due=date(2026, 1, 1))
        with pytest.raises(aioq.ArgumentError, match="argument 'due' must be date, got str"):
            await ship.defer(conn, order=ORDER, due="2026-01-01")  # type: ignore[arg-type]
        with pytest.raises(aioq.ArgumentError, match=re.escape(message)):
            await ship.defer_many(
                conn, [{"order": ORDER, "due": date.today()}, {"order": bad, "due": date.today()}]
            )
        with pytest.raises(aioq.ArgumentError, match=re.escape(message)):
            ship.call(order=bad, due=date(2026, 1, 1))
        assert await conn.fetchval("SELECT count(*) FROM aioq.jobs") == 1
    with psycopg.connect(dsn) as sync_conn:
        with pytest.raises(aioq.ArgumentError, match=re.escape(message)):
            ship.defer_sync(sync_conn, order=bad, due=date(2026, 1, 1))
        assert sync_conn.execute("SELECT count(*) FROM aioq.jobs").fetchone() == (1,)


CONTROL = 10  # good jobs among the bad ones


async def test_stored_values_that_cannot_be_read_go_dead_at_once_while_workers_serve(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    """Several workers with 1 s leases, one of them hard-cancelled mid-flight: each bad job is
    dead after one attempt with the argument and path in last_error; every good job runs."""
    done: list[int] = []

    @registry.task(name="values.ship", max_attempts=5, lease=1.0)
    async def ship(order: Order, due: date) -> None:
        await anyio.sleep(0.05)
        done.append(aioq.current_job().id)

    good = {"order": ORDER_JSON, "due": "2026-12-31"}
    bad = [
        ({**good, "due": "tomorrow"}, "argument 'due' must be date (ISO 8601 text), got str"),
        (
            {**good, "order": {**ORDER_JSON, "lines": [{"sku": "a"}, {"qty": 1}]}},
            "argument 'order.lines[1]' lacks the field 'sku', which Line requires",
        ),
        (
            {**good, "order": {**ORDER_JSON, "id": "not-a-uuid"}},
            "argument 'order.id' must be UUID (a UUID string), got str 'not-a-uuid'",
        ),
        (
            {**good, "order": {**ORDER_JSON, "notes": {"x": "green"}}},
            "argument 'order.notes' has the key 'x', which must be an integer key",
        ),
    ]
    insert = (
        "INSERT INTO aioq.jobs (task, args, max_attempts) VALUES ($1, $2::jsonb, 5) RETURNING id"
    )
    bad_ids = {}
    for round_ in range(3):
        for args, message in bad:
            job_id = await conn.fetchval(insert, ship.name, orjson.dumps(args).decode())
            bad_ids[job_id] = message
        await ship.defer_many(conn, [{"order": ORDER, "due": date(2026, 1, round_ + 1)}] * CONTROL)
    workers = [make_worker(concurrency=4) for _ in range(3)]
    doomed = anyio.CancelScope()

    async def hard_cancelled() -> None:
        with doomed:
            await workers[0].run()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hard_cancelled)
            for worker in workers[1:]:
                tg.start_soon(worker.run)
            await eventually(lambda: len(done) >= 3, "the first good jobs")
            doomed.cancel()  # claims and all: the reaper gives them back after 1 s
            await eventually(
                lambda: conn.fetchval("SELECT count(*) = $1 FROM aioq.jobs", len(bad_ids)),
                "only the bad jobs left",
            )
            await eventually(
                lambda: conn.fetchval("SELECT bool_and(status = 'dead') FROM aioq.jobs"),
                "every bad job dead",
            )
            for worker in workers[1:]:
                worker.stop()
    assert len(set(done)) == 3 * CONTROL
    rows = await conn.fetch("SELECT id, status, attempts, last_error FROM aioq.jobs")
    assert {r["id"] for r in rows} == set(bad_ids)
    for row in rows:
        # One attempt (two if the hard cancel caught it: rescued, then read again).
        assert row["status"] == "dead", dict(row)
        assert row["attempts"] <= 2, dict(row)
        error = row["last_error"]
        assert error.startswith(f"PayloadError: cannot call {ship.name!r} with its stored"), error
        assert bad_ids[row["id"]] in error
    # Never retried: read once and dead (a claim the hard cancel cut short is read once more).
    assert any(row["attempts"] == 1 for row in rows)


async def test_results_come_back_typed_from_upstream_and_the_workflow(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    seen: list[dict[str, Any]] = []

    @registry.task(name="values.quote", result_ttl=60)
    async def quote(order: Order) -> Invoice:
        return INVOICE.model_copy(update={"number": len(order.lines)})

    @registry.task(name="values.pick")
    def pick(order: Order) -> list[Line]:
        return order.lines

    @registry.task(name="values.send")
    async def send() -> dict[str, datetime]:
        seen.append(await aioq.current_job().upstream())
        return {"sent": datetime(2026, 5, 1, tzinfo=UTC)}

    flow = aioq.Workflow("typed")
    parents = [flow.add(quote.call(order=ORDER), name="quote"), flow.add(pick.call(order=ORDER))]
    flow.add(send.call(), after=parents, name="send")
    run = await flow.defer(conn)
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()
    [up] = seen
    assert same(up["quote"], INVOICE.model_copy(update={"number": 2}))
    assert same(up["pick"], ORDER.lines)
    info = await aioq.workflow(conn, run.id, registry=registry)
    assert info is not None
    results = {s.name: s.result for s in info.steps}
    assert same(results["send"], {"sent": datetime(2026, 5, 1, tzinfo=UTC)})
    assert same(results["pick"], ORDER.lines)
    untyped = await aioq.workflow(conn, run.id)  # no registry: the JSON as stored
    assert untyped is not None
    assert {s.name: s.result for s in untyped.steps}["send"] == {
        "sent": "2026-05-01T00:00:00+00:00"
    }
    assert same(await quote.result(conn, run.jobs["quote"]), up["quote"])


async def test_a_return_value_that_does_not_fit_fails_the_attempt(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task(name="values.bad_result", result_ttl=60, max_attempts=1)
    async def bad_result() -> date:
        return "2026-01-01"  # type: ignore[return-value]

    job_id = await bad_result.defer(conn)
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()
    row = await conn.fetchrow("SELECT status, last_error FROM aioq.jobs WHERE id = $1", job_id)
    assert row is not None
    assert row["status"] == "dead"
    assert row["last_error"] == (
        "ResultError: task 'values.bad_result': return value must be date, got str '2026-01-01'"
    )


async def test_a_stored_result_that_cannot_be_read_raises_a_result_error(
    conn: asyncpg.Connection, registry: aioq.Registry, make_worker: Callable[..., aioq.Worker]
) -> None:
    @registry.task(name="values.when", result_ttl=60)
    async def when() -> str:
        return "soon"

    job_id = await when.defer(conn)
    with anyio.fail_after(HANG_GUARD):
        await make_worker().run_until_idle()

    redeployed = aioq.Registry()  # the task returns a date now

    @redeployed.task(name="values.when", result_ttl=60)
    async def when_v2() -> date:
        return date.today()

    with pytest.raises(ResultError, match="stored return value cannot be read: must be date"):
        await when_v2.result(conn, job_id)
    assert await aioq.result(conn, job_id) == "soon"


async def test_testing_helpers_show_the_arguments_as_the_task_reads_them(
    conn: asyncpg.Connection, registry: aioq.Registry
) -> None:
    @registry.task(name="values.remind")
    async def remind(due: date, who: uuid.UUID) -> None: ...

    await remind.defer(conn, due=date(2026, 3, 1), who=uuid.UUID(int=1))
    [job] = await aioq.testing.deferred(conn, remind)
    assert job.args == {"due": date(2026, 3, 1), "who": uuid.UUID(int=1)}


async def test_periodic_kwargs_are_typed_values_too(registry: aioq.Registry) -> None:
    @aioq.periodic(every=60, kwargs={"level": Level.HIGH, "since": timedelta(hours=1)})
    @registry.task(name="values.report")
    async def report(level: Level, since: timedelta) -> None: ...

    [schedule] = registry.schedules.values()
    assert orjson.loads(schedule.args) == {"level": 2, "since": "PT1H"}
    with pytest.raises(aioq.errors.ConfigError, match="argument 'level' must be Level, got int 3"):
        aioq.periodic(every=60, kwargs={"level": 3, "since": timedelta(0)}, name="other")(report)


def test_the_cli_defer_reads_the_json_forms_as_the_task_does(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "typedtasks.py").write_text(
        "import datetime, uuid\nimport aioq\nregistry = aioq.Registry()\n\n"
        "@registry.task(name='remind')\n"
        "async def remind(due: datetime.date, who: uuid.UUID) -> None: ...\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "AIOQ_DSN": dsn}
    aioq_bin = Path(sys.executable).parent / "aioq"
    ok = subprocess.run(
        [str(aioq_bin), "defer", "typedtasks:registry", "remind", "--args",
         '{"due": "2026-03-01", "who": "00000000000000000000000000000001"}'],
        env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [str(aioq_bin), "defer", "typedtasks:registry", "remind", "--args",
         '{"due": "someday", "who": "00000000000000000000000000000001"}'],
        env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "argument 'due' must be date (ISO 8601 text), got str 'someday'" in bad.stderr

    async def stored() -> list[str]:
        conn = await asyncpg.connect(dsn)
        try:
            return [r[0] for r in await conn.fetch("SELECT args::text FROM aioq.jobs")]
        finally:
            await conn.close()

    [args] = anyio.run(stored)
    # Read as the task reads it, written back in the canonical form.
    assert orjson.loads(args) == {"due": "2026-03-01", "who": str(uuid.UUID(int=1))}


# --- pydantic only when an annotation needs it --------------------------------------------------


def test_import_aioq_and_a_plain_task_never_import_pydantic(dsn: str, tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(
        "import sys, asyncio, datetime, uuid, dataclasses\nimport aioq\n"
        "registry = aioq.Registry()\n"
        "@dataclasses.dataclass\nclass P:\n    day: datetime.date\n\n"
        "@registry.task(name='plain')\n"
        "async def plain(n: int, who: uuid.UUID, p: P, tags: list[str] | None = None) -> None:\n"
        "    pass\n"
        "async def main():\n"
        "    import asyncpg\n"
        f"    conn = await asyncpg.connect({dsn!r})\n"
        "    await plain.defer(conn, n=1, who=uuid.uuid4(), p=P(datetime.date.today()))\n"
        f"    await aioq.Worker(dsn={dsn!r}, registry=registry).run_until_idle()\n"
        "    assert await conn.fetchval('SELECT count(*) FROM aioq.jobs') == 0\n"
        "    await conn.close()\n"
        "asyncio.run(main())\n"
        "print('pydantic' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", out.stderr


# --- mypy: typed defer and results --------------------------------------------------------------

_EXPECTED = re.compile(r"# error: \[([a-z-]+)\]")
_REPORTED = re.compile(r"^[^:]+:(\d+): error: .*\[([a-z-]+)\]$")


def test_mypy_checks_typed_arguments_and_types_results(tmp_path: Path) -> None:
    path = TYPING / "typed_values.py"
    expected = {
        (n, m.group(1))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if (m := _EXPECTED.search(line))
    }
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
         "--show-error-codes", "--cache-dir", str(tmp_path / "cache"), str(path)],
        capture_output=True, text=True, cwd=TYPING.parent.parent, timeout=900,
    )  # fmt: skip
    reported = {
        (int(m.group(1)), m.group(2))
        for line in out.stdout.splitlines()
        if (m := _REPORTED.match(line))
    }
    assert reported == expected, out.stdout + out.stderr


def test_duration_text_matches_pydantic() -> None:
    adapter = pydantic.TypeAdapter(timedelta)
    for value in (
        timedelta(days=1, hours=2, minutes=3, seconds=4.5),
        timedelta(seconds=-1),
        timedelta(hours=-25, microseconds=3),
        timedelta(0),
        timedelta(microseconds=1),
        timedelta(days=40),
    ):
        assert orjson.dumps(duration_text(value)) == adapter.dump_json(value)
        assert adapter.validate_json(orjson.dumps(duration_text(value))) == value
