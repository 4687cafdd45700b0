"""The Hugging Face side of an export: when a run's model is a transformers
`PreTrainedModel`, its `config.json` beside the weights (so `from_pretrained` builds the
same model and loads them), and the names it ties left out of the weights, as
`save_pretrained` leaves them out (the model ties them again when it loads)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runner.models.builders import build_model
from runner.spec import RunSpec


def built_shapes(spec: RunSpec) -> nn.Module | None:
    """The run's model on the meta device (shapes only); None when it needs what only the
    data reports (an argument such as num_classes), or cannot be built on meta."""
    try:
        with torch.device("meta"):
            return build_model(spec.model, {})
    except Exception:
        return None


def is_hugging_face(module: nn.Module | None) -> bool:
    config = getattr(module, "config", None)
    return config is not None and hasattr(config, "save_pretrained")


def tied_names(module: nn.Module) -> set[str]:
    """Every name of a tensor shared under several names, but the first."""
    seen: set[int] = set()
    tied = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(name)
        seen.add(id(tensor))
    return tied


def write_config(module: nn.Module, directory: Path) -> list[Path]:
    """config.json (and generation_config.json for a model that generates)."""
    module.config.save_pretrained(directory)
    written = [directory / "config.json"]
    generation = getattr(module, "generation_config", None)
    if generation is not None and module.can_generate():
        generation.save_pretrained(directory)
        written.append(directory / "generation_config.json")
    return written
