"""Models whose passes run out of memory on purpose, for the grad_accum=auto tests."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from runner.models.builders import mlp


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.samples = x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError(
            f"backward pass ran out of memory with a microbatch of {ctx.samples} samples"
        )


class BackwardOom(nn.Module):
    """runner's mlp, whose backward pass raises torch.OutOfMemoryError on global rank `rank`
    while a training microbatch holds more than `above` samples."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, rank: int = 1, above: int = 11
    ):
        super().__init__()
        self.net = mlp(input_shape, num_classes)
        self.rank, self.above = rank, above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        here = int(os.environ.get("RANK", "0")) == self.rank
        if self.training and here and x.shape[0] > self.above:
            out = _RaiseInBackward.apply(out)
        return out
