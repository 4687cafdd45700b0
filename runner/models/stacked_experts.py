"""init_from of a Hugging Face mixture of experts saved one tensor per expert.

Checkpoints on the Hub (and what `save_pretrained` and `runner export` write) hold an
expert's weights as tensors of their own (`model.layers.0.block_sparse_moe.experts.3.w1
.weight`), while transformers 5 builds the model with each layer's experts stacked
(`model.layers.0.mlp.experts.gate_up_proj`: every expert's w1 and w3, stacked by expert and
joined) and converts as `from_pretrained` loads. init_from does the same for the tensors the
file lacks under the model's names: transformers' own reverse conversion, run on the meta
device, names the file tensors each stacked tensor is made of; transformers' forward
conversion for it says how they join (stacked by expert, then concatenated), and each is
read as a source of its own, assembled from its parts when read, one tensor at a time. Only
those two kinds of joining are read; a model converted otherwise keeps the usual missing
and unexpected names.

A stacked source is named `stacked:` + JSON (how to join, the file's names of the parts),
so the matching, the launcher's check and the ranks' reads pass it as any file name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

MARK = "stacked:"
JOINS = {"MergeModulelist": "stack", "Concatenate": "cat"}  # transformers' op: how it joins


def stacked_sources(
    model: nn.Module, missing: dict[str, tuple[int, ...]], file_names: Iterable[str]
) -> dict[str, str]:
    """For each `missing` model tensor (name: shape) that the file holds in parts, its
    stacked source's name; for one it holds under another name only, that name."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, revert_weight_conversion
    except ImportError:  # transformers 4 keeps every expert apart: the names match
        return {}
    if not missing or getattr(model, "config", None) is None:
        return {}
    try:
        converters = [
            c
            for c in get_model_conversion_mapping(model, add_legacy=False)
            if isinstance(c, WeightConverter)
        ]
    except Exception:  # a model transformers has no mapping for
        return {}
    names = set(file_names)
    found = {}
    for name, shape in missing.items():
        parts = list(revert_weight_conversion(model, {name: torch.empty(shape, device="meta")}))
        converter = _converter_for(name, converters)
        if parts == [name] or not set(parts) <= names:
            continue
        if converter is None:  # renamed only (Mixtral's block_sparse_moe.gate: mlp.gate)
            if len(parts) == 1:
                found[name] = parts[0]
            continue
        joins = [JOINS.get(type(op).__name__) for op in converter.operations]
        if None in joins:
            continue
        dims = [op.dim for op in converter.operations]
        patterns = converter.source_patterns
        groups = [[p for p in parts if _matches(pattern, p)] for pattern in patterns]
        if sum(map(len, groups)) != len(parts) or not all(groups):
            continue
        joined = list(zip(joins, dims, strict=True))
        found[name] = MARK + json.dumps({"joins": joined, "groups": groups})
    return found


def parts_of(source: str) -> list[str]:
    """The file's names a stacked source is made of."""
    return [p for group in json.loads(source[len(MARK) :])["groups"] for p in group]


def _converter_for(name: str, converters: list[Any]) -> Any | None:
    for converter in converters:
        if any(_matches(target, name) for target in converter.target_patterns):
            return converter
    return None


def _matches(pattern: str, name: str) -> bool:
    """transformers' pattern (`*` a number; a suffix of the name) matches `name`."""
    regex = re.escape(pattern.lstrip(".")).replace(r"\*", r"\d+")
    return re.search(r"(^|\.)" + regex + "$", name) is not None


class StackedReads:
    """A tensor file that also reads stacked sources (assembled from their parts)."""

    def __init__(self, file: Any):
        self.file = file

    def names(self) -> list[str]:
        return self.file.names()

    def shape(self, name: str) -> tuple[int, ...]:
        if not name.startswith(MARK):
            return self.file.shape(name)
        meta = _join(name, lambda part: torch.empty(self.file.shape(part), device="meta"))
        return tuple(meta.shape)

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        if not name.startswith(MARK):
            return self.file.read(name, start, count)
        whole = _join(name, lambda part: self.file.read(part).view(self.file.shape(part)))
        flat = whole.reshape(-1)
        end = flat.numel() if count is None else start + count
        return flat[start:end]

    def close(self) -> None:
        self.file.close()

    def __getattr__(self, attribute: str) -> Any:  # the file's other readers (dtype, ...)
        return getattr(self.file, attribute)


def _join(source: str, tensor: Any) -> torch.Tensor:
    """A stacked source's tensor: each group's parts stacked, then the groups joined."""
    recipe = json.loads(source[len(MARK) :])
    pieces: list[Any] = [[tensor(part) for part in group] for group in recipe["groups"]]
    for join, dim in recipe["joins"]:
        if join == "stack":
            pieces = [torch.stack(group, dim=dim) for group in pieces]
        else:
            pieces = [torch.cat(pieces, dim=dim)]
    if len(pieces) != 1:
        raise ValueError(f"{source}: the parts do not join into one tensor")
    return pieces[0]
