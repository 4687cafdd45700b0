"""Turn plain config data (dicts, lists, scalars) into the typed dataclasses of the schema.

Every problem is collected, not just the first, and each one names the full key,
the bad value and what would be valid. No torch here: this runs in the parent.

Why not pydantic v2, which does this job: measured on this machine (medians of 7
interleaved runs), validating a RunSpec with pydantic's TypeAdapter cost 54 ms more
import and 64 ms to build the schema and validate, against 2.7 ms here, on a parent
start of 0.47 s (`runner --cfg job`): +25% for --help, --cfg and every config error.
It would still need code of ours for what makes the messages useful: options told
apart by `name`, flat component nodes (`_target_` beside runner's own keys), bounds
and valid values phrased as `key=value: ...`. Revisit if the schema outgrows this file.
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, Literal, TypeVar, Union

from runner.components import TARGET

T = TypeVar("T")


class SpecError(ValueError):
    """A run spec that cannot be used. `problems` holds one line per problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class _Invalid(Exception):
    """One bad value; converted into a problem line by the caller, or into the lines of
    its bad items (`items`: a list whose items are each said once, not the list too)."""

    def __init__(self, message: str, items: list[str] | None = None):
        super().__init__(message)
        self.items = items or []


_NOTHING = object()
_DOTTED_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build `cls` from `data`, raising SpecError with every problem found."""
    problems: list[str] = []
    result = _convert_dataclass(cls, data, path, problems)
    if problems:
        raise SpecError(problems)
    return result


def describe(tp: Any) -> str:
    """A short human description of what a type accepts, for error messages."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(m.value for m in tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(describe(args[0]))}"
        return f"a list of {len(args)} values"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _plural(text: str) -> str:
    return text.replace("an integer", "integers").replace("a number", "numbers")


def _key(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A schema class's field types, its string annotations evaluated once (they never change;
    evaluating them was most of a spec's conversion, which parallelism=auto's planner runs for
    each candidate layout)."""
    return typing.get_type_hints(cls)


def _convert_dataclass(cls: type, data: Any, path: str, problems: list[str]) -> Any:
    if getattr(cls, "component", False):
        return _convert_component(cls, data, path, problems)
    if not isinstance(data, Mapping):
        problems.append(f"{path or 'config'}={data!r}: expected a mapping")
        return None
    hints = _hints(cls)
    fields = {config_key(f.name): f for f in dataclasses.fields(cls)}
    for extra in sorted(set(data) - set(fields)):
        problems.append(
            f"{_key(path, str(extra))}: unknown key; valid keys here: {', '.join(sorted(fields))}"
        )
    values: dict[str, Any] = {}
    for config_name, f in fields.items():
        name = f.name
        key = _key(path, config_name)
        raw = data.get(config_name, _NOTHING)
        if raw is _NOTHING:
            continue  # the dataclass default applies
        before = len(problems)
        value = _convert(hints[name], raw, key, problems)
        if len(problems) == before:
            bound_problem = _check_bounds(f.metadata, value)
            if bound_problem:
                problems.append(f"{key}={raw!r}: {bound_problem}")
            values[name] = value
    try:
        return cls(**values)
    except TypeError as exc:  # a required field missing: a schema bug or a missing key
        problems.append(f"{path or 'config'}: {exc}")
        return None


def _convert_component(cls: type, data: Any, path: str, problems: list[str]) -> Any:
    """`_target_`, runner's own keys of this node (the dataclass's fields), and the target's
    arguments (everything else, kept as written)."""
    if not isinstance(data, Mapping):
        problems.append(
            f"{path}={data!r}: expected a mapping with `_target_` (a dotted path) and its arguments"
        )
        return None
    target = data.get(TARGET)
    if not isinstance(target, str) or not _DOTTED_PATH.fullmatch(target):
        problems.append(
            f"{path}.{TARGET}={target!r}: expected the dotted path of a class or function, "
            f"such as {path}.{TARGET}=mypackage.module.Name"
        )
    own = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("target", "args")}
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for name, f in own.items():
        if name not in data:
            continue
        before = len(problems)
        value = _convert(hints[name], data[name], _key(path, name), problems)
        if len(problems) == before:
            bound_problem = _check_bounds(f.metadata, value)
            if bound_problem:
                problems.append(f"{_key(path, name)}={data[name]!r}: {bound_problem}")
            values[name] = value
    args = {k: v for k, v in data.items() if k != TARGET and k not in own}
    return cls(target=target if isinstance(target, str) else "", args=args, **values)


def _convert(tp: Any, raw: Any, key: str, problems: list[str]) -> Any:
    try:
        return _convert_value(tp, raw, key, problems)
    except _Invalid as exc:
        problems.extend(exc.items or [f"{key}={raw!r}: {exc}"])
        return None


def _convert_value(tp: Any, raw: Any, key: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, raw, key, problems)
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, raw, key, problems)
    if tp is Any:
        return raw
    if tp is type(None):
        if raw is None:
            return None
        raise _Invalid("expected null")
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        raise _Invalid("expected true or false")
    if tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise _Invalid("expected an integer")
    if tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        raise _Invalid("expected a number")
    if tp is str:
        if isinstance(raw, str):
            return raw
        raise _Invalid("expected a string")
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(raw)
        except ValueError:
            raise _Invalid(f"expected {describe(tp)}") from None
    if origin is Literal:
        if isinstance(raw, float) and math.isnan(raw) and "nan" in typing.get_args(tp):
            return "nan"  # the command line's `nan` arrives as a float
        if raw in typing.get_args(tp) and not isinstance(raw, bool):
            return raw
        raise _Invalid(f"expected {describe(tp)}")
    if origin is tuple:
        return _convert_tuple(tp, raw, key, problems)
    if origin is dict or tp is dict:
        if not isinstance(raw, Mapping):
            raise _Invalid("expected a mapping")
        key_type, value_type = typing.get_args(tp) or (str, Any)
        if not dataclasses.is_dataclass(value_type):  # keys as written (`{5: 2.0}`: "5")
            return {str(k) if key_type is str else k: v for k, v in raw.items()}
        # A mapping of components (metrics): `name: null` leaves an entry out.
        return {
            str(name): _convert(value_type, item, _key(key, str(name)), problems)
            for name, item in raw.items()
            if item is not None
        }
    raise TypeError(f"schema type {tp!r} of {key} is not supported")  # a bug, not user input


def _convert_tuple(tp: Any, raw: Any, key: str, problems: list[str]) -> tuple:
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise _Invalid(f"expected {describe(tp)}")
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        item_types = [args[0]] * len(raw)
    elif len(args) == len(raw):
        item_types = list(args)
    else:
        raise _Invalid(f"expected {describe(tp)}")
    bad: list[str] = []  # said by the caller: each item's line, or the union's own
    items = tuple(
        _convert(t, item, f"{key}[{i}]", bad)
        for i, (t, item) in enumerate(zip(item_types, raw, strict=True))
    )
    if bad:
        raise _Invalid(f"expected {describe(tp)}", bad)
    return items


def _convert_union(tp: Any, raw: Any, key: str, problems: list[str]) -> Any:
    options = typing.get_args(tp)
    variants = [o for o in options if dataclasses.is_dataclass(o)]
    if variants and len(variants) == len([o for o in options if o is not type(None)]):
        if raw is None and type(None) in options:
            return None
        if len(variants) == 1:  # an optional section: no tag needed
            return _convert_dataclass(variants[0], raw, key, problems)
        return _convert_tagged(variants, raw, key, problems)
    for option in options:  # scalars: the first option that accepts the value wins
        try:
            return _convert_value(option, raw, key, problems)
        except _Invalid:
            continue
    raise _Invalid(f"expected {describe(tp)}")


def _convert_tagged(variants: list[type], raw: Any, key: str, problems: list[str]) -> Any:
    """Unions of dataclasses are told apart by their `name` field (a config group option)."""
    by_name: dict[str, type] = {}
    for variant in variants:
        name_type = _hints(variant)["name"]
        for name in typing.get_args(name_type):
            by_name[name] = variant
    if not isinstance(raw, Mapping):
        raise _Invalid("expected a mapping with a `name`")
    name = raw.get("name")
    if name not in by_name:
        problems.append(f"{key}.name={name!r}: expected one of {', '.join(by_name)}")
        return None
    return _convert_dataclass(by_name[name], raw, key, problems)


def _check_bounds(limits: Mapping[str, float], value: Any) -> str | None:
    if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if "min" in limits and value < limits["min"]:
        return f"must be >= {limits['min']:g}"
    if "gt" in limits and value <= limits["gt"]:
        return f"must be > {limits['gt']:g}"
    if "max" in limits and value > limits["max"]:
        return f"must be <= {limits['max']:g}"
    if "lt" in limits and value >= limits["lt"]:
        return f"must be < {limits['lt']:g}"
    return None


def config_key(field_name: str) -> str:
    """A field's key in the config: its name, less the underscore that lets a Python keyword
    be a field (checkpoint.async is the field `async_`)."""
    bare = field_name.rstrip("_")
    return bare if field_name.endswith("_") and keyword.iskeyword(bare) else field_name


def to_dict(obj: Any) -> Any:
    """The plain-data form of a spec (enums as their values), fit for YAML."""
    if getattr(obj, "component", False) and not isinstance(obj, type):
        own = [f.name for f in dataclasses.fields(obj) if f.name not in ("target", "args")]
        return {
            TARGET: obj.target,
            **to_dict(obj.args),
            **{n: to_dict(getattr(obj, n)) for n in own},
        }
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {config_key(f.name): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"optimizer": {"lr": 0.1}, "tags": {}}` -> `{"optimizer.lr": 0.1, "tags": {}}`: an
    empty mapping is a value of its own."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat
