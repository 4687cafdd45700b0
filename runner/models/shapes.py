"""Names and shapes of a model's state: what a checkpoint must match to be resumed.

The parent never imports torch or user code, so when it has to compare a checkpoint with
a model configured differently it runs `python -m runner.models.shapes` with the run spec
(YAML) on stdin; the data is built for what it reports (num_classes, ...), the model on
the meta device (no memory, no init cost), and its state's names and shapes are printed
as JSON. A process that has imported torch already calls `configured_state_shapes`.
"""

from __future__ import annotations

import json
import sys

import yaml
from torch import nn

from runner.data.datasets import build_datasets
from runner.models.builders import build_model
from runner.spec import RunSpec, from_dict


def state_shapes(module: nn.Module) -> list[tuple[str, list[int]]]:
    """(name, shape) of every entry of `module.state_dict()`, in its order."""
    return [(name, list(value.shape)) for name, value in module.state_dict().items()]


def multiplying_parameters(module: nn.Module) -> int:
    """How many parameters take part in matrix products (FLOPs per token: 6 each): all but
    the nn.Embedding tables, which only look up. A ZeRO-3 parameter counts whole (its
    `ds_numel`), not the part this rank holds."""
    looked_up = {
        id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    return sum(
        getattr(p, "ds_numel", p.numel()) for p in module.parameters() if id(p) not in looked_up
    )


def configured_state_shapes(spec: RunSpec) -> list[tuple[str, list[int]]]:
    import torch

    info = build_datasets(spec.data).info
    with torch.device("meta"):
        return state_shapes(build_model(spec.model, info))


if __name__ == "__main__":
    run_spec = from_dict(RunSpec, yaml.safe_load(sys.stdin.read()))
    json.dump(configured_state_shapes(run_spec), sys.stdout)
