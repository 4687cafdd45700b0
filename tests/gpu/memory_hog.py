"""A model whose forward pass needs more device memory than is free at a full microbatch, and
three quarters of what is free at half: a real out-of-memory error that grad_accum=auto
recovers from by halving the microbatch. Sized at the first training forward pass from the
memory free then (after the weights, the optimizer and the data are on the device), not
from the card's size."""

from __future__ import annotations

import math

import torch
from torch import nn


class MemoryHog(nn.Module):
    def __init__(self, input_shape: list[int], num_classes: int, batch: int, fill: float = 1.5):
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_classes)
        self.batch, self.fill = batch, fill
        self.floats_per_sample: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if not self.training:
            return self.linear(x)
        if self.floats_per_sample is None:  # the first pass, at the full microbatch
            free, _ = torch.cuda.mem_get_info(x.device)
            self.floats_per_sample = int(self.fill * free / self.batch / 4)  # fp32
        # batch x floats_per_sample on the device for a moment (nothing kept for backward)
        hog = torch.ones(x.shape[0], self.floats_per_sample, device=x.device)
        return self.linear(x) + hog[:, :1] * 0.0
