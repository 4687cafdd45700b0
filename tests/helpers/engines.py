"""An engine built the way a rank builds one: the model through runner's parallelize(), the
spec's parallelism over the running group."""

from __future__ import annotations

from typing import Any

from torch import nn

from runner import dist as rdist
from runner.spec.mesh import layout


def engine_of(spec: Any, model: nn.Module, total_steps: int, device: str = "cpu") -> Any:
    from runner.train.build.parallelize import parallelize

    grid = layout(spec, rdist.get_world_size())
    return parallelize(model, spec, grid, device, total_steps).engine
