"""Built-in evaluation metrics, in torchmetrics' shape: `update(outputs, targets)`,
`compute()`, `reset()`. `compute()` returns the value over every rank's batches, as
torchmetrics' own metrics do under torch.distributed, so a torchmetrics metric works as a
`metrics` component unchanged (its arguments, such as num_classes, come from the data).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runner import dist as rdist


class _Summed:
    """A metric made of sums, all-reduced once in compute()."""

    def __init__(self, size: int):
        self.size = size
        self.reset()

    def reset(self) -> None:
        self.totals = torch.zeros(self.size, dtype=torch.float64)

    def add(self, *values: torch.Tensor | float) -> None:
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
        if device is not None and self.totals.device != device:
            self.totals = self.totals.to(device)
        self.totals += torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values]).to(
            self.totals.device
        )

    def reduced(self) -> list[float]:
        totals = self.totals.clone()
        rdist.all_reduce(totals)
        return totals.tolist()


class Accuracy(_Summed):
    """Top-1 accuracy of logits [N, C] against class indices [N]."""

    def __init__(self) -> None:
        super().__init__(2)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        correct = (outputs.argmax(dim=-1) == targets).sum()
        self.add(correct, torch.tensor(targets.numel(), device=targets.device))

    def compute(self) -> float:
        correct, total = self.reduced()
        return correct / total if total else math.nan


class Perplexity(_Summed):
    """exp(mean next-token loss) of a causal language model: logits [N, T, V], tokens [N, T];
    targets equal to `ignore_index` are left out."""

    def __init__(self, ignore_index: int = -100) -> None:
        super().__init__(2)
        self.ignore_index = ignore_index

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        logits, shifted = outputs[:, :-1].float(), targets[:, 1:]
        nll = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            shifted.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        self.add(nll, (shifted != self.ignore_index).sum())

    def compute(self) -> float:
        nll, count = self.reduced()
        return math.exp(nll / count) if count else math.nan
