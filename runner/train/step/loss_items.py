"""What a step's loss is divided by: the items of the whole global batch (samples, or the
tokens a loss counts itself with `count(targets)`; runner.train.losses has the contract),
counted on every rank before any forward pass, and checked against the loss once.

Neither makes the host wait for the device on a step that logs nothing: tokens are counted
in the batch as the loader made it, on the host, and the ranks sum their counts in one
all-reduce of a tensor filled on the device (no copy from the host); the check compares its
counts where the host reads device values anyway, at the first log step's reduction.
"""

from __future__ import annotations

from typing import Any

import torch

from runner import dist as rdist
from runner.train.step.batch_parts import split


class GlobalItems:
    """Samples in a step's global batch, or, for a loss that counts its own items (tokens),
    those of every microbatch on every rank: a host number where every rank knows it, else
    a tensor on the device (an all-reduce). `copies`: ranks that read each batch (a tensor
    group's). `fixed_length`: the data's samples all hold the same items (packed token
    blocks, no padding), so every rank knows the sum from the sample count: no collective."""

    def __init__(self, loss_fn: Any, device: str, copies: int = 1, fixed_length: bool = False):
        self.count = getattr(loss_fn, "count", None)
        self.device, self.copies, self.fixed_length = device, copies, fixed_length
        self.per_sample: float | None = None  # fixed_length: a sample's items, counted once

    def of(self, microbatches: list[tuple[Any, bool]], n_global: int) -> Any:
        if self.count is None:
            return n_global
        if self.fixed_length:
            if self.per_sample is None:
                self.per_sample = _per_sample(self.count, microbatches)
            if self.per_sample is not None:
                return float(n_global * self.per_sample)
        return self._reduced(microbatches)

    def _reduced(self, microbatches: list[tuple[Any, bool]]) -> Any:
        on_host, on_device = 0, []
        for batch, real, *_ in microbatches:
            if not real:
                continue
            counted = self.count(split(batch)[2])
            if isinstance(counted, torch.Tensor) and counted.device.type != "cpu":
                on_device.append(counted)  # a batch already on the device: it stays there
            else:
                on_host += int(counted)
        if rdist.get_world_size() == 1 and not on_device:
            return float(on_host)
        total = torch.full((), float(on_host), dtype=torch.float64, device=self.device)
        for counted in on_device:
            total += counted
        return (rdist.all_reduce(total) / self.copies).float()


def _per_sample(count: Any, microbatches: list[tuple[Any, bool]]) -> float | None:
    """A sample's items, from the first real microbatch on the host (None: none here)."""
    for batch, real, *_ in microbatches:
        targets = split(batch)[2]
        if real and isinstance(targets, torch.Tensor) and targets.device.type == "cpu":
            return int(count(targets)) / len(targets)
    return None


class ItemCheck:
    """The first step's item counts, each microbatch's as its loss returned them against
    what its targets hold (its `count(targets)`, or its samples). Host numbers are compared
    at once; counts on the device wait for `verify`, which the ranks call where they read
    the device anyway (reducing log records, before a checkpoint, at the end)."""

    def __init__(self, loss_fn: Any, target: str):
        self.loss_fn, self.target = loss_fn, target  # `target` names the loss in the error
        self.open = True  # noting the first step's microbatches
        self.pending: list[tuple[Any, Any]] = []

    def note(self, count: Any, targets: Any) -> None:
        if not self.open:
            return
        expected = self.loss_fn.count(targets) if self.counts_itself else len(targets)
        if isinstance(count, torch.Tensor) or isinstance(expected, torch.Tensor):
            self.pending.append((count, expected))
        else:
            self._compare(count, expected)

    def step_done(self) -> None:
        self.open = False

    def verify(self) -> None:
        pending, self.pending = self.pending, []
        for count, expected in pending:
            self._compare(count, expected)

    @property
    def counts_itself(self) -> bool:
        return hasattr(self.loss_fn, "count")

    def _compare(self, count: Any, expected: Any) -> None:
        if int(count) == int(expected):
            return
        raise ValueError(
            f"loss._target_={self.target}: returned {int(count)} items for a microbatch of "
            f"{int(expected)} "
            + ("(its count(targets))" if self.counts_itself else "samples")
            + "; a loss whose items are not samples (tokens) needs a count(targets) method "
            "so every split of the batch is weighted alike"
        )
