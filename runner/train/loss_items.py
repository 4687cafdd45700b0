"""What a step's loss is divided by: the items of the whole global batch (samples, or the
tokens a loss counts itself with `count(targets)`; runner.train.losses has the contract),
counted on every rank before any forward pass, and checked against the loss once."""

from __future__ import annotations

from typing import Any

import torch

from runner import dist as rdist
from runner.train.batch_parts import split


def global_items(
    loss_fn: Any, microbatches: list[tuple[Any, bool]], n_global: int, device: str
) -> Any:
    """Samples in the global batch, or, for a loss that counts its own items (tokens),
    those of every microbatch on every rank (an all-reduce)."""
    count = getattr(loss_fn, "count", None)
    if count is None:
        return n_global
    local = sum(count(split(batch)[2]) for batch, real in microbatches if real)
    total = torch.as_tensor(local, dtype=torch.float64).to(device)
    return rdist.all_reduce(total).float()


def check_items(loss_fn: Any, target: str, count: Any, targets: Any) -> None:
    """On the first step only (it syncs with the host): the loss's item count agrees with
    the one the step was weighted by. `target` names the loss in the error."""
    counts_itself = hasattr(loss_fn, "count")
    expected = loss_fn.count(targets) if counts_itself else len(targets)
    if int(count) != int(expected):
        raise ValueError(
            f"loss._target_={target}: returned {int(count)} items for a microbatch of "
            f"{int(expected)} "
            + ("(its count(targets))" if counts_itself else "samples")
            + "; a loss whose items are not samples (tokens) needs a count(targets) method "
            "so every split of the batch is weighted alike"
        )
