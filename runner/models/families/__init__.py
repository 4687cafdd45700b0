"""The model families runner knows, each a module of this package that declares one (its
`FAMILY`, a runner.models.families.family.Family); found by looking at the package, not
listed: a new family is a new module here. A model, or a model._target_, belongs to the
first family (by `order`) that claims it; one no family claims to the generic family."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING

from runner.models.families.family import Family

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Family", "families", "family_of", "family_of_target"]


@functools.cache
def families() -> tuple[Family, ...]:
    """Every family declared in this package, in the order they are asked; the generic last."""
    found = [Family()]
    for module in pkgutil.iter_modules(__path__):
        declared = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
        if isinstance(declared, Family):
            found.append(declared)
    return tuple(sorted(found, key=lambda family: family.order))


def family_of(model: nn.Module) -> Family:
    """The family of `model` (built, or on the meta device)."""
    return next(family for family in families() if family.claims(model))


def family_of_target(target: str) -> Family:
    """The family of the model `target` (model._target_) builds, before it is built."""
    return next(family for family in families() if family.builds(target))
