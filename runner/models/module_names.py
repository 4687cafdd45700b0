"""A model's modules named by patterns, as the user's and Hugging Face's plans name them
(`model.layers.*.mlp.experts`: `*` stands for a layer number): the tensor plan's, the expert
plan's and the pipeline's alike."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

V = TypeVar("V")


def expand_patterns(model: nn.Module, plan: dict[str, V]) -> tuple[dict[str, V], list[str]]:
    """The plan by module (or parameter) name, `*` standing for a layer number; and the
    patterns that name nothing in the model."""
    import re

    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    expanded: dict[str, V] = {}
    unmatched = []
    for pattern, value in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        hits = [name for name in names if regex.fullmatch(name)]
        if not hits:
            unmatched.append(pattern)
        expanded.update(dict.fromkeys(hits, value))
    return expanded, unmatched
