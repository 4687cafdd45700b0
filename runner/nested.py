"""Nested config mappings as flat dotted keys."""

from __future__ import annotations

from typing import Any


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
