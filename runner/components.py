"""Components: user code (or runner's own) named by `_target_`, built with Hydra's instantiate.

A component node is `_target_` (a dotted path to a class or function) plus its arguments,
with Hydra's `_partial_`, `_args_` and nested `_target_` nodes. Values the run knows
(`provided`: what the data reports, such as num_classes or vocab_size) reach a target only
when its signature names them and the config leaves them unset, so a user never repeats them.

`problems()` checks a node without calling anything: every `_target_` imports, is callable,
its arguments bind to its signature, and each value fits its annotation where that is a
scalar type, a Literal, an Enum, a union or a list of these. The agent runs it before any
rank starts (the parent never imports user code).
"""

from __future__ import annotations

import collections.abc
import difflib
import enum
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from runner.errors import describe

TARGET = "_target_"  # the key that names a component's class or function (Hydra's)
_HYDRA_KEYS = {TARGET, "_partial_", "_args_", "_recursive_", "_convert_"}


class ComponentError(ValueError):
    """A component that cannot be located or bound; the message names the key."""


def locate(path: str) -> Any:
    """The object at a dotted path: the longest importable module prefix, then attributes.

    Raises ComponentError naming the missing module or attribute."""
    parts = path.split(".")
    module, found = None, 0
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not name.startswith(exc.name):
                raise ComponentError(f"importing {name} failed: {exc}") from None
            continue
        found = i
        break
    if module is None:
        raise ComponentError(f"no module named {parts[0]!r}")
    obj = module
    for i, attr in enumerate(parts[found:], start=found):
        if not hasattr(obj, attr):
            where = ".".join(parts[:i])
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = difflib.get_close_matches(attr, names, n=1)
            suffix = f"; did you mean {hint[0]}?" if hint else ""
            raise ComponentError(f"{where} has no attribute {attr!r}{suffix}")
        obj = getattr(obj, attr)
    return obj


def _parameters(target: Any) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # some builtins have no signature: nothing to check
        return None


def injected(target: Any, args: Mapping[str, Any], provided: Mapping[str, Any]) -> dict[str, Any]:
    """The provided values `target` takes by name and `args` leaves unset."""
    params = _parameters(target) or {}
    named = {
        n
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in args
    }
    return {name: value for name, value in provided.items() if name in named}


def instantiate(node: Mapping[str, Any], provided: Mapping[str, Any] | None = None) -> Any:
    """Build the component `node` (plain data), passing it what it takes of `provided`."""
    from hydra.utils import instantiate as hydra_instantiate

    node = dict(node)
    node.setdefault("_convert_", "all")  # plain lists and dicts, not OmegaConf containers
    extra = injected(locate(node[TARGET]), node, provided or {})
    return hydra_instantiate(node, **extra)


def problems(
    key: str,
    node: Mapping[str, Any],
    provided: Mapping[str, Any] | Callable[[], Mapping[str, Any] | None] = (),
) -> list[str]:
    """Everything wrong with component `node` at config key `key`, nested targets included.

    `provided` (or a function returning it, called only when a required argument is
    missing) holds the values runner passes itself; None when they cannot be known, and
    then no argument is reported missing."""
    found: list[str] = []
    _check(key, node, provided, found)
    return found


def _check(key: str, node: Mapping[str, Any], provided: Any, found: list[str]) -> None:
    target = _target(key, node, found)
    if target is None:
        return
    for name, value in node.items():  # nested components first: their problems stand alone
        if isinstance(value, Mapping) and TARGET in value:
            _check(f"{key}.{name}", value, {}, found)
    params = _parameters(target)
    if params is not None:
        _check_arguments(key, node, target, params, provided, found)


def _target(key: str, node: Mapping[str, Any], found: list[str]) -> Callable[..., Any] | None:
    """The callable `_target_` names, or None with the reason in `found`."""
    path = node.get(TARGET)
    try:
        target = locate(str(path))
    except ComponentError as exc:
        found.append(f"{key}.{TARGET}={path}: {exc}")
        return None
    except Exception as exc:  # the user's module raised while importing
        found.append(f"{key}.{TARGET}={path}: importing it raised {describe(exc)}")
        return None
    if not callable(target):
        found.append(
            f"{key}.{TARGET}={path}: is a {type(target).__name__}, not a class or function"
        )
        return None
    return target


def _check_arguments(
    key: str,
    node: Mapping[str, Any],
    target: Callable[..., Any],
    params: Mapping[str, inspect.Parameter],
    provided: Any,
    found: list[str],
) -> None:
    """The node's arguments against the target's signature and type hints: unknown names,
    mismatched types, an argument given twice, required ones missing."""
    path = node.get(TARGET)
    args = {k: v for k, v in node.items() if k not in _HYDRA_KEYS}
    positional = list(node.get("_args_") or [])
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not takes_kwargs:
        for name in args:
            if name not in params or params[name].kind is params[name].POSITIONAL_ONLY:
                hint = difflib.get_close_matches(name, named, n=1)
                takes = f"; it takes {', '.join(named)} (~{key}.{name} drops it)"
                found.append(
                    f"{key}.{name}: unexpected argument of {path}"
                    + (f"; did you mean {hint[0]}?" if hint else takes)
                )
    hints = _type_hints(target)
    for name, value in args.items():
        if name in hints and name in params and not _is_component(value):
            expected = _mismatch(hints[name], value, params[name].default)
            if expected is not None:
                where = f"as {path} annotates it"
                found.append(f"{key}.{name}={value!r}: expected {expected} ({where})")
    by_position = [
        n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][: len(positional)]
    for name in by_position:
        if name in args:
            found.append(f"{key}.{name}: given twice to {path}, by `_args_` and by name")
    if node.get("_partial_"):
        return  # the rest of the arguments come when it is called
    missing = [
        n
        for n, p in params.items()
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and n not in args
        and n not in by_position
    ]
    if missing and callable(provided):
        provided = provided()
    if provided is None:
        return  # what runner passes is unknown (the data itself is broken): no guessing
    missing = [n for n in missing if n not in provided]
    for name in missing:
        found.append(f"{key}.{name}: missing; {path} needs it (set +{key}.{name}=...)")


def _is_component(value: Any) -> bool:
    return isinstance(value, Mapping) and TARGET in value


def _type_hints(target: Any) -> dict[str, Any]:
    """The target's argument annotations, resolved; none where they cannot be."""
    function = target.__init__ if inspect.isclass(target) else target
    try:
        return typing.get_type_hints(function)
    except Exception:  # a name it cannot resolve, a forward reference: nothing to check
        return {}


def _mismatch(annotation: Any, value: Any, default: Any) -> str | None:
    """What `annotation` expects, when `value` cannot be of it; None when it can (or when
    the annotation is one runner does not judge)."""
    if value is None and default is None:
        return None  # `x: int = None`: None is what the author passes too
    return None if _fits(annotation, value) is not False else _describe(annotation)


def _fits(annotation: Any, value: Any) -> bool | None:
    """True or False where the annotation is a scalar type, a Literal, an Enum, a union or
    a list or tuple of these; None (cannot tell) for anything else."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        results = [_fits(a, value) for a in args]
        return True if True in results else (None if None in results else False)
    if annotation is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:  # a number is a string too, written plainly
        return isinstance(value, str | int | float) and not isinstance(value, bool)
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return value in annotation.__members__ or value in {m.value for m in annotation}
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, list | tuple):
            return False
        items = args[:1] if origin is not tuple or args[-1:] == (...,) else args
        if not items:
            return True
        if origin is tuple and args[-1:] != (...,) and len(args) != len(value):
            return False
        results = [_fits(items[min(i, len(items) - 1)], v) for i, v in enumerate(value)]
        return False if False in results else (None if None in results else True)
    return None


def _describe(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in annotation)
    if origin in (list, tuple, collections.abc.Sequence) and args:
        return f"a list of {_describe(args[0])}"
    return getattr(annotation, "__name__", str(annotation))
