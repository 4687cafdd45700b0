"""A run's initial weights: one seeded build, the same on every rank and at every layout.

A rank that holds the whole model builds it from the seed (`build_data_and_model`). Under
fsdp and zero3 with `parallelism.meta_init` no rank holds the whole model, so each node's
launcher builds it once on the CPU, before any rank starts, in the same order (seed, data,
model), and writes its tensors to the run directory (`write_seed_weights`): a seed
checkpoint, as torchtitan makes one. Each rank then fills in only its own shards from that
file, one tensor at a time (runner.train.build.sharded_init, through runner.models.tensor_files).
The weights are those of a run that built the whole model on every rank, bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import random
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

from runner.data.datasets import build_datasets
from runner.data.splits import Datasets
from runner.models.builders import build_model
from runner.models.families import family_of
from runner.models.safetensors_out import OutTensor, write_file
from runner.spec import RunSpec

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_data_and_model(
    spec: RunSpec, construction: AbstractContextManager | None = None
) -> tuple[Datasets, nn.Module]:
    """The data and the model, built from the seed in this order (the data may draw from
    the same generators); the model under `construction` (the meta device, ZeRO-3's
    partitioning) when given, else on the CPU."""
    seed_everything(spec.seed)
    data = build_datasets(spec.data)
    with construction or contextlib.nullcontext():
        module = build_model(spec.model, data.info)
    ready = family_of(module).ready_to_train(module)
    if ready:
        log.info("model: %s", ready)
    return data, module


def meta_init_applies(spec: RunSpec) -> bool:
    """Whether the ranks build the model without its weights (fsdp, zero3 with meta_init)."""
    return spec.parallelism.meta_init


def seed_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too: a rank has no other source for
    them), by the name the module gives it; a tensor shared under two names once."""
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    return {name: t.detach().contiguous() for name, t in tensors.items()}


def write_seed_weights(spec: RunSpec, path: Path) -> int | None:
    """Build the model as a rank would and write its tensors to `path` (safetensors),
    atomically: a reader sees the whole file or none. Returns the bytes written; None, with
    nothing built, where init_from's file holds every tensor (pretrained_fills_all)."""
    if pretrained_fills_all(spec):
        return None
    _, module = build_data_and_model(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = [
        OutTensor(name, tuple(t.shape), t.dtype, partial(_itself, t))
        for name, t in seed_tensors(module).items()
    ]
    write_file(path, tensors)  # several nodes on one filesystem: the same bytes, any order
    return path.stat().st_size


def _itself(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def pretrained_fills_all(spec: RunSpec) -> bool:
    """Whether init_from's file fills every parameter and buffer of the model, the
    non-persistent buffers too (`runner eval` of a run, a whole model fine-tuned): then the
    ranks read nothing from seed weights. Decided on the meta device, nothing allocated."""
    if spec.init_from.path is None:
        return False
    from runner.models.checkpoint_weights import weights_file
    from runner.models.pretrained import loaded_tensors, match

    _, module = build_data_and_model(spec, torch.device("meta"))
    with weights_file(Path(spec.init_from.path)) as file:
        sources = match(file, loaded_tensors(module), spec.init_from, module).sources
    return set(seed_tensors(module)) <= sources.keys()
