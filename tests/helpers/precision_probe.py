"""What a rank computes in, seen from inside the model, and a CPU rank that sees autocast as a
GPU rank does.

`ProbeMLP` is the mlp (flatten, linear, relu, linear) that says once, on its first training
forward pass, the dtypes it met: its input, the first layer's weight as the forward pass
sees it, and that layer's output (`dtype probe: ...` in the rank's log).

`TanhBlocks` is the two-block model the engine-level fp16 tests step by hand.

`AutocastAsOnCuda` (a callback, on every rank) makes `torch.is_autocast_enabled()` without a
device answer for the CPU, as it answers for CUDA on a GPU. Libraries ask it that way:
DeepSpeed's engine does, and switches off an enclosing autocast when it says yes (unless
its torch_autocast section is on). On a CPU rank it says no, so what fails on a GPU passed
on the CPU; with this, it fails here the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

PROBE = "dtype probe:"


class ProbeMLP(nn.Module):
    def __init__(self, input_shape: list[int], num_classes: int, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)
        self.said = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        hidden = self.fc1(x)
        if self.training and not self.said:
            self.said = True
            print(
                f"{PROBE} input={_name(x.dtype)} weight={_name(self.fc1.weight.dtype)} "
                f"output={_name(hidden.dtype)}",
                flush=True,
            )
        return self.fc2(torch.relu(hidden))


class TanhBlocks(nn.Module):
    """Two 8-wide linear blocks with tanh: FSDP shards each, ZeRO partitions them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def probed(log: str) -> dict[str, str]:
    """The dtypes a rank's log says its model met: {"input": ..., "weight": ..., "output": ...}."""
    line = next(line for line in log.splitlines() if PROBE in line)
    return dict(part.split("=") for part in line.split(PROBE)[1].split())


class AutocastAsOnCuda:
    """On every rank (`ranks: all`), from the start of training."""

    def on_fit_start(self, run: Any) -> None:
        if getattr(torch.is_autocast_enabled, "as_on_cuda", False):
            return
        asked = torch.is_autocast_enabled

        def is_autocast_enabled(device_type: str | None = None) -> bool:
            return asked(device_type or "cpu")

        is_autocast_enabled.as_on_cuda = True  # type: ignore[attr-defined]
        torch.is_autocast_enabled = is_autocast_enabled
