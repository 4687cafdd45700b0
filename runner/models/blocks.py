"""A model's blocks, and activation checkpointing applied to them.

A block is the unit a model repeats: the layers of a transformer, the stages of a deep
network. They are found without help as the largest `nn.ModuleList` (or `nn.Sequential`)
whose children all share one class (the gpt model's `blocks`, a Hugging Face model's
`h` or `layers`), or named by class.

Activation checkpointing keeps only each checkpointed block's input during the forward
pass and recomputes the block in the backward pass: activation memory for compute. It
is non-reentrant (torch.utils.checkpoint with use_reentrant=False) and leaves the
module tree and state_dict keys as they were, so checkpoints and model.pt do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


def find_blocks(module: nn.Module, classes: Sequence[str] = ()) -> list[nn.Module]:
    """The model's blocks, in order: modules of the named classes, or else the children of
    its largest container of same-class modules (none if it has no such container)."""
    if classes:
        wanted = set(classes)
        return [m for m in module.modules() if type(m).__name__ in wanted]
    best: list[nn.Module] = []
    for candidate in module.modules():
        if not isinstance(candidate, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(candidate.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if len(children) > len(best) and list(children[0].parameters()):
            best = children
    return best


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(module: nn.Module, every: int) -> int:
    """Checkpoint every `every`-th block (1: all of them). Returns how many were wrapped.

    Raises ValueError when the model has no blocks to checkpoint."""
    blocks = find_blocks(module)
    if not blocks:
        raise ValueError(
            f"activation_checkpointing: {type(module).__name__} has no blocks (a ModuleList "
            "of modules of one class) to checkpoint; use activation_checkpointing=none"
        )
    chosen = blocks[every - 1 :: every]
    for block in chosen:
        block.forward = functools.partial(_checkpointed, block.forward)
    return len(chosen)
