"""A model whose forward pass needs more device memory than the GPU has at a full
microbatch, and three quarters of it at half: a real out-of-memory error that
grad_accum=auto recovers from by halving the microbatch once."""

from __future__ import annotations

import math

import torch
from torch import nn


class MemoryHog(nn.Module):
    def __init__(self, input_shape: list[int], num_classes: int, batch: int, fill: float = 1.5):
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_classes)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        self.floats_per_sample = int(fill * total / batch / 4)  # fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if not self.training:
            return self.linear(x)
        # batch x floats_per_sample on the device for a moment (nothing kept for backward)
        hog = torch.ones(x.shape[0], self.floats_per_sample, device=x.device)
        return self.linear(x) + hog[:, :1] * 0.0
