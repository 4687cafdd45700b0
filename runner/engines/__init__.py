"""Engines own the model's distribution: how gradients are synced and the optimizer steps.

`build_engine` picks one by `parallelism.name`; the trainer only sees `Engine`
(runner.engines.base). Nothing here imports torch until an engine is built, so
the parent can use `runner.spec.deepspeed_config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from runner.engines.base import Engine, Fill
    from runner.spec import RunSpec


def build_engine(
    spec: RunSpec,
    module: nn.Module,
    device: str,
    total_steps: int,
    fill: Fill | None = None,
) -> Engine:
    """The engine of `spec.parallelism` around `module`. `fill`: the module was built
    without its weights (runner.train.build.sharded_init); the engine calls it once the module
    is sharded, before it builds the optimizer."""
    if fill is not None and spec.parallelism.name not in ("zero3", "fsdp"):
        raise ValueError(f"parallelism={spec.parallelism.name} needs the whole model built")
    if spec.parallelism.name == "ddp":
        from runner.engines.ddp import DDPEngine

        return DDPEngine(spec, module, device, total_steps)
    if spec.parallelism.name in ("zero1", "zero2", "zero3"):
        from runner.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(spec, module, device, total_steps, fill)
    if spec.parallelism.name == "fsdp":
        from runner.engines.fsdp import FSDPEngine

        return FSDPEngine(spec, module, device, total_steps, fill)
    raise ValueError(f"parallelism.name={spec.parallelism.name!r} has no engine")
