"""Engines own the model's distribution: how gradients are synced and the optimizer steps.

`build_engine` picks one by `parallelism.name`; the trainer only sees `Engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.engines.base import Engine

if TYPE_CHECKING:
    from torch import nn

    from runner.spec import RunSpec


def build_engine(spec: RunSpec, module: nn.Module, device: str, total_steps: int) -> Engine:
    if spec.parallelism.name == "ddp":
        from runner.engines.ddp import DDPEngine

        return DDPEngine(spec, module, device, total_steps)
    raise ValueError(f"parallelism.name={spec.parallelism.name!r} has no engine")


__all__ = ["Engine", "build_engine"]
