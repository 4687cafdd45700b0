"""A batch as a tree of tensors (tensors inside dicts, tuples and lists, however nested)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors_once(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`batch` with `fn` applied to each of its tensors, once per tensor object: one that
    appears twice (a text batch's input_ids and labels) is pinned or copied once, and its
    result appears in both places."""
    done: dict[int, torch.Tensor] = {}

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in done:
                done[id(value)] = fn(value)
            return done[id(value)]
        if isinstance(value, Mapping):
            return {k: visit(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(visit(v) for v in value)
        return value

    return visit(batch)


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor of `batch`, each once, in the order they appear."""
    found: list[torch.Tensor] = []
    map_tensors_once(batch, lambda tensor: found.append(tensor) or tensor)
    return found


def pinned(batch: Any) -> Any:
    """`batch` in page-locked memory, each tensor pinned once (the copy to a GPU can then
    run beside the step)."""
    return map_tensors_once(batch, torch.Tensor.pin_memory)
