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
    """A metric made of sums, all-reduced once in compute(). A tensor value is summed on its
    device, a Python number on the host: no batch copies a host number to the device (on a
    GPU, a copy the host waits for); compute() joins them once."""

    def __init__(self, size: int):
        self.size = size
        self.reset()

    def reset(self) -> None:
        self.totals = torch.zeros(self.size, dtype=torch.float64)
        self.host = [0.0] * self.size

    def add(self, *values: torch.Tensor | float) -> None:
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
        if device is None:  # numbers only
            self.host = [total + float(v) for total, v in zip(self.host, values, strict=True)]
            return
        if self.totals.device != device:
            self.totals = self.totals.to(device)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        summed = []
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                summed.append(value.to(torch.float64).reshape(()))
            else:
                self.host[i] += float(value)
                summed.append(zero)
        self.totals += torch.stack(summed)

    def reduced(self) -> list[float]:
        host = torch.tensor(self.host, dtype=torch.float64, device=self.totals.device)
        totals = self.totals + host
        rdist.all_reduce(totals)
        return totals.tolist()


class Accuracy(_Summed):
    """Top-1 accuracy of logits [N, C] against class indices [N]."""

    def __init__(self) -> None:
        super().__init__(2)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        correct = (outputs.argmax(dim=-1) == targets).sum()
        self.add(correct, targets.numel())  # a count the host knows: summed there

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
