"""What a batch looks like to the training loop, whatever the data component produced.

- A mapping (a Hugging Face-style batch): `labels` are the targets, every other entry is
  a keyword argument of the model.
- A tuple or list: the last element is the targets, the others are the model's
  positional arguments (`(inputs, labels)` is the common case).

Tensors are moved to the device however deeply they are nested. The model's output is
used as is when it is a tensor, else its `logits` (an output object or a dict).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runner.data.tensor_tree import map_tensors_once

LABELS = "labels"


def to_device(batch: Any, device: torch.device | str, channels_last: bool = False) -> Any:
    """`batch` on `device`, each tensor copied once (runner.data.tensor_tree)."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(device, non_blocking=True)
        if channels_last and moved.dim() == 4 and moved.is_floating_point():
            moved = moved.contiguous(memory_format=torch.channels_last)
        return moved

    return map_tensors_once(batch, move)


def split(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """(positional inputs, keyword inputs, targets) of one batch."""
    if isinstance(batch, Mapping):
        if LABELS not in batch:
            raise ValueError(
                f"a dict batch needs a {LABELS!r} entry (the targets); it has {sorted(batch)}"
            )
        return (), {k: v for k, v in batch.items() if k != LABELS}, batch[LABELS]
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return tuple(batch[:-1]), {}, batch[-1]
    raise ValueError(
        f"a batch must be a dict with {LABELS!r} or a tuple (inputs..., targets); "
        f"got {type(batch).__name__}"
    )


def logits_of(outputs: Any) -> Any:
    """The model's predictions: the tensor it returned, or the `logits` it holds."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    return getattr(outputs, "logits", outputs)


def batch_size(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor."""
    size = _first_dimension(batch)
    if size is None:
        raise ValueError("grad_accum=auto: a batch needs a tensor with the samples first to cut")
    return size


def _first_dimension(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (Mapping, tuple, list)):
        for value in batch.values() if isinstance(batch, Mapping) else batch:
            size = _first_dimension(value)
            if size is not None:
                return size
    return None
