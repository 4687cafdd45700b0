"""The loss and a metric, in runner's contracts.

A loss returns (summed loss, number of items): here one item per sample, so no `count`
method is needed. A metric has update/compute/reset, and compute() returns the value over
every rank (runner.dist.all_reduce is a no-op outside a process group).
"""

from __future__ import annotations

import torch

from runner import dist


class SquaredError:
    """Sum over samples of the squared error, summed over the outputs."""

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        return ((outputs.float() - targets) ** 2).sum(), targets.shape[0]


class MeanAbsoluteError:
    def __init__(self, column: int = 0):
        self.column = column
        self.reset()

    def reset(self) -> None:
        self.totals = torch.zeros(2, dtype=torch.float64)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        error = (outputs[:, self.column] - targets[:, self.column]).abs()
        self.totals += torch.stack([error.sum().double().cpu(), torch.tensor(len(error) * 1.0)])

    def compute(self) -> float:
        totals = dist.all_reduce(self.totals.clone())
        return (totals[0] / totals[1]).item()
