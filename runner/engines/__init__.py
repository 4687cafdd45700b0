"""Engines step a distributed model: how gradients are synced and the optimizer steps, how
checkpoints are written. How the model is distributed is decided before, in one place
(runner.train.build.parallelize), and handed over as a `RankModel` (runner.engines.rank_model).

`build_engine` picks one by `parallelism.name`; the trainer only sees `Engine`
(runner.engines.base). Nothing here imports torch until an engine is built, so
the parent can use `runner.spec.deepspeed_config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.engines.base import Engine
    from runner.engines.rank_model import RankModel
    from runner.spec import RunSpec


def import_library(name: str) -> None:
    """Import the library parallelism `name` runs on (DeepSpeed for zero1/2/3), so that its
    memory is part of a rank's base, measured before the model is built."""
    if name in ("zero1", "zero2", "zero3"):
        import deepspeed  # noqa: F401
    elif name == "fsdp":
        import torch.distributed.fsdp  # noqa: F401


def build_engine(spec: RunSpec, rank_model: RankModel) -> Engine:
    """The engine of `spec.parallelism` around what `rank_model` says this rank holds. A RankModel's
    `fill`: the module was built without its weights (runner.train.build.sharded_init); the
    engine calls it once the module is sharded, before it builds the optimizer."""
    if rank_model.fill is not None and spec.parallelism.name not in ("zero3", "fsdp"):
        raise ValueError(f"parallelism={spec.parallelism.name} needs the whole model built")
    if spec.parallelism.name == "ddp":
        from runner.engines.ddp import DDPEngine

        return DDPEngine(spec, rank_model)
    if spec.parallelism.name in ("zero1", "zero2", "zero3"):
        from runner.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(spec, rank_model)
    if spec.parallelism.name == "fsdp":
        from runner.engines.fsdp import FSDPEngine

        return FSDPEngine(spec, rank_model)
    raise ValueError(f"parallelism.name={spec.parallelism.name!r} has no engine")
