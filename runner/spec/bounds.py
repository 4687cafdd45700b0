"""A dataclass field with a default and the bounds its value must keep (`min`, `gt`, `max`),
which runner.spec.convert checks, naming the bound, when it builds the spec."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def bound(default: Any, **limits: float) -> Any:
    return field(default=default, metadata=limits)
