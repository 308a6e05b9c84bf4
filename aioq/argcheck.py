"""Check ``defer``'s arguments against the task's signature: names, and the simple annotations.

What is checked (everything else is accepted as the JSON codec allows):

- ``int`` (not ``bool``), ``float`` (an ``int`` is accepted), ``str``, ``bool``, ``None``;
- ``list`` and ``list[X]``, ``dict`` and ``dict[str, X]`` with ``X`` checked the same way;
- unions of these (``X | None``, ``Optional[X]``, ``Union[...]``);
- a ``TypedDict``: a dict with its required keys, no others, each value checked.

A union with a member that is not listed here, ``Any``, ``object``, a class of your own or an
annotation that cannot be resolved is not checked. Checkers are compiled once per task, on the
first ``defer``, so forward references to names defined later in the module resolve.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Union, get_args, get_origin, get_type_hints, is_typeddict

__all__ = ("ArgsChecker", "compile_checker", "explain_mismatch")

# A check takes a value and its path from the argument ("ids[2]"); it returns None, or the
# problem: "argument 'ids[2]' must be int, got str 'a'". Messages are built only on failure.
Check = Callable[[object, str], str | None]
ArgsChecker = Callable[[Mapping[str, object]], str | None]


class Compiled(NamedTuple):
    """A compiled annotation: its check, its label, and the types it accepts without a look.

    ``fast`` lets a container test all its items in C (``set(map(type, items)) <= fast``)
    and call ``check`` per item only when that fails: a 64 KB list of ints or of plain dicts
    costs no Python call per item.
    """

    check: Check
    label: str
    fast: frozenset[type]


_SCALARS: dict[object, tuple[tuple[type, ...], str]] = {
    int: ((int,), "int"),
    float: ((float, int), "float"),
    str: ((str,), "str"),
    bool: ((bool,), "bool"),
    type(None): ((type(None),), "None"),
    None: ((type(None),), "None"),
}


def _exact(kinds: tuple[type, ...], label: str) -> Compiled:
    # type() rather than isinstance: bool is an int subclass, and the codec stores only
    # exact built-in types anyway.
    def check(value: object, path: str) -> str | None:
        return None if type(value) in kinds else _wrong(path, label, value)

    return Compiled(check, label, frozenset(kinds))


def _list(item: Compiled | None) -> Compiled:
    if item is None:
        return _exact((list,), "list")
    check_item, label, fast = item
    label = f"list[{label}]"

    def check(value: object, path: str) -> str | None:
        if type(value) is not list:
            return _wrong(path, label, value)
        if set(map(type, value)) <= fast:
            return None
        for i, element in enumerate(value):
            failed = check_item(element, f"{path}[{i}]")
            if failed is not None:
                return failed
        return None

    return Compiled(check, label, frozenset())


def _dict(item: Compiled | None) -> Compiled:
    if item is None:
        return _exact((dict,), "dict")
    check_item, label, fast = item
    label = f"dict[str, {label}]"

    def check(value: object, path: str) -> str | None:
        if type(value) is not dict:
            return _wrong(path, label, value)
        if set(map(type, value.values())) <= fast:
            return None
        for key, element in value.items():
            failed = check_item(element, f"{path}[{key!r}]")
            if failed is not None:
                return failed
        return None

    return Compiled(check, label, frozenset())


def _union(members: list[Compiled]) -> Compiled:
    label = " | ".join(m.label for m in members)
    checks = [m.check for m in members]
    others = [m.check for m in members if m.label != "None"]
    optional = len(others) == 1 and len(members) == 2  # X | None

    def check(value: object, path: str) -> str | None:
        if optional and value is not None:
            return others[0](value, path)  # says which part of an X failed, not just "X | None"
        for member in checks:
            if member(value, path) is None:
                return None
        return _wrong(path, label, value)

    return Compiled(check, label, frozenset().union(*(m.fast for m in members)))


def _typed_dict(tp: Any) -> Compiled | None:
    try:
        hints = get_type_hints(tp)
    except Exception:  # an unresolvable forward reference: leave it unchecked
        return None
    compiled = {name: _compile(hint, 0) for name, hint in hints.items()}
    fields = {name: c for name, c in compiled.items() if c is not None}
    declared = compiled.keys()
    required = frozenset(tp.__required_keys__)
    label: str = tp.__name__

    def check(value: object, path: str) -> str | None:
        if type(value) is not dict:
            return _wrong(path, label, value)
        if not (required <= value.keys() <= declared):  # the common case, in C
            for key in required:
                if key not in value:
                    return f"argument {path!r} lacks the key {key!r}, which {label} requires"
            for key in value:
                if key not in declared:
                    return f"argument {path!r} has the key {key!r}, which {label} does not declare"
        for key, element in value.items():
            field = fields.get(key)
            if field is not None and type(element) not in field.fast:
                failed = field.check(element, f"{path}[{key!r}]")
                if failed is not None:
                    return failed
        return None

    return Compiled(check, label, frozenset())


def _compile(tp: Any, depth: int) -> Compiled | None:
    """Return the compiled check of a supported annotation, else None (unchecked)."""
    if depth > 10:
        return None
    if tp in _SCALARS:
        return _exact(*_SCALARS[tp])
    if tp is list or tp is typing.List:  # noqa: UP006
        return _list(None)
    if tp is dict or tp is typing.Dict:  # noqa: UP006
        return _dict(None)
    if is_typeddict(tp):
        return _typed_dict(tp)
    origin, args = get_origin(tp), get_args(tp)
    if origin is list and len(args) == 1:
        return _list(_compile(args[0], depth + 1))
    if origin is dict and len(args) == 2:
        return _dict(_compile(args[1], depth + 1) if args[0] is str else None)
    if origin is Union or origin is types.UnionType:
        members = [_compile(arg, depth + 1) for arg in args]
        if any(m is None for m in members):
            return None  # a member we do not know might accept anything
        return _union([m for m in members if m is not None])
    return None


def _annotations(fn: Callable[..., object], signature: inspect.Signature) -> dict[str, Any]:
    try:
        return get_type_hints(fn)
    except Exception:
        pass
    # One unresolvable annotation: resolve the others one by one.
    found: dict[str, Any] = {}
    namespace = getattr(fn, "__globals__", {})
    for name, param in signature.parameters.items():
        annotation = param.annotation
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, namespace)  # the task's own module's text
            except Exception:
                continue
        if annotation is not inspect.Parameter.empty:
            found[name] = annotation
    return found


def compile_checker(fn: Callable[..., object], signature: inspect.Signature) -> ArgsChecker | None:
    """Return a function checking keyword arguments' values, or None if nothing is checked."""
    hints = _annotations(fn, signature)
    named: list[tuple[str, frozenset[type], Check]] = []
    extra: Check | None = None
    for name, param in signature.parameters.items():
        compiled = _compile(hints[name], 0) if name in hints else None
        if compiled is None:
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = compiled.check
        else:
            named.append((name, compiled.fast, compiled.check))
    if not named and extra is None:
        return None
    declared = frozenset(signature.parameters)

    def check(arguments: Mapping[str, object]) -> str | None:
        for name, fast, checker in named:
            if name in arguments:
                value = arguments[name]
                if type(value) in fast:  # the common case, without a call
                    continue
                failed = checker(value, name)
                if failed is not None:
                    return failed
        if extra is not None:
            for name, value in arguments.items():
                if name not in declared:
                    failed = extra(value, name)
                    if failed is not None:
                        return failed
        return None

    return check


def _wrong(path: str, expected: str, value: object) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"argument {path!r} must be {expected}, got {type(value).__name__} {text}"


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
