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
from typing import Any, Union, get_args, get_origin, get_type_hints, is_typeddict

__all__ = ("ArgsChecker", "compile_checker", "explain_mismatch")

# A check takes a value and its path from the argument ("ids[2]"); it returns None, or the
# problem: "argument 'ids[2]' must be int, got str 'a'". Messages are built only on failure.
Check = Callable[[object, str], str | None]
ArgsChecker = Callable[[Mapping[str, object]], str | None]

_SCALARS: dict[object, tuple[tuple[type, ...], str]] = {
    int: ((int,), "int"),
    float: ((float, int), "float"),
    str: ((str,), "str"),
    bool: ((bool,), "bool"),
    type(None): ((type(None),), "None"),
    None: ((type(None),), "None"),
}


def _exact(kinds: tuple[type, ...], label: str) -> tuple[Check, str]:
    # type() rather than isinstance: bool is an int subclass, and the codec stores only
    # exact built-in types anyway.
    def check(value: object, path: str) -> str | None:
        return None if type(value) in kinds else _wrong(path, label, value)

    return check, label


def _list(item: tuple[Check, str] | None, kinds: frozenset[type]) -> tuple[Check, str]:
    if item is None:
        return _exact((list,), "list")
    check_item, label = item

    def check(value: object, path: str) -> str | None:
        if type(value) is not list:
            return _wrong(path, f"list[{label}]", value)
        for element in value:
            if type(element) not in kinds:  # a list of scalars costs no call per item
                break
        else:
            return None
        for i, element in enumerate(value):
            failed = check_item(element, f"{path}[{i}]")
            if failed is not None:
                return failed
        return None

    return check, f"list[{label}]"


def _dict(item: tuple[Check, str] | None) -> tuple[Check, str]:
    if item is None:
        return _exact((dict,), "dict")
    check_item, label = item

    def check(value: object, path: str) -> str | None:
        if type(value) is not dict:
            return _wrong(path, f"dict[str, {label}]", value)
        for key, element in value.items():
            failed = check_item(element, f"{path}[{key!r}]")
            if failed is not None:
                return failed
        return None

    return check, f"dict[str, {label}]"


def _union(members: list[tuple[Check, str]]) -> tuple[Check, str]:
    label = " | ".join(m[1] for m in members)
    checks = [m[0] for m in members]
    others = [m[0] for m in members if m[1] != "None"]
    optional = len(others) == 1 and len(members) == 2  # X | None

    def check(value: object, path: str) -> str | None:
        if optional and value is not None:
            return others[0](value, path)  # says which part of an X failed, not just "X | None"
        for member in checks:
            if member(value, path) is None:
                return None
        return _wrong(path, label, value)

    return check, label


def _typed_dict(tp: Any) -> tuple[Check, str] | None:
    try:
        hints = get_type_hints(tp)
    except Exception:  # an unresolvable forward reference: leave it unchecked
        return None
    fields = {name: _compile(hint, 0) for name, hint in hints.items()}
    required = frozenset(tp.__required_keys__)
    label: str = tp.__name__

    def check(value: object, path: str) -> str | None:
        if type(value) is not dict:
            return _wrong(path, label, value)
        for key in required:
            if key not in value:
                return f"argument {path!r} lacks the key {key!r}, which {label} requires"
        for key in value:
            if key not in fields:
                return f"argument {path!r} has the key {key!r}, which {label} does not declare"
        for key, element in value.items():
            field = fields[key]
            if field is not None:
                failed = field[0](element, f"{path}[{key!r}]")
                if failed is not None:
                    return failed
        return None

    return check, label


def _compile(tp: Any, depth: int) -> tuple[Check, str] | None:
    """Return a checker and its label for a supported annotation, else None (unchecked)."""
    if depth > 10:
        return None
    if tp in _SCALARS:
        return _exact(*_SCALARS[tp])
    if tp is list or tp is typing.List:  # noqa: UP006
        return _list(None, frozenset())
    if tp is dict or tp is typing.Dict:  # noqa: UP006
        return _dict(None)
    if is_typeddict(tp):
        return _typed_dict(tp)
    origin, args = get_origin(tp), get_args(tp)
    if origin is list and len(args) == 1:
        return _list(_compile(args[0], depth + 1), _fast_types(args[0]))
    if origin is dict and len(args) == 2:
        return _dict(_compile(args[1], depth + 1) if args[0] is str else None)
    if origin is Union or origin is types.UnionType:
        members = [_compile(arg, depth + 1) for arg in args]
        if any(m is None for m in members):
            return None  # a member we do not know might accept anything
        return _union([m for m in members if m is not None])
    return None


def _fast_types(tp: Any) -> frozenset[type]:
    """Return the types a value of this annotation is accepted by with no further look."""
    if tp in _SCALARS:
        return frozenset(_SCALARS[tp][0])
    if tp is list or tp is dict:
        return frozenset({tp})
    if get_origin(tp) is Union or get_origin(tp) is types.UnionType:
        return frozenset().union(*(_fast_types(arg) for arg in get_args(tp)))
    return frozenset()


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
            extra = compiled[0]
        else:
            named.append((name, _fast_types(hints[name]), compiled[0]))
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
