"""Models that cannot be built on the meta device (runner.train.build.sharded_init falls back to
building them whole): one reads its weights while it is built, one keeps a tensor that is
neither a parameter nor a buffer. Both take what the digits data reports."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


class ReadsItsWeights(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_classes: int):
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_classes)
        self.scale = float(self.linear.weight.abs().max())  # a value: none on the meta device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1)) / self.scale


class KeepsAStrayTensor(nn.Module):
    def __init__(self, input_shape: Sequence[int], num_classes: int):
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_classes)
        self.offset = torch.zeros(num_classes)  # neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1)) + self.offset
