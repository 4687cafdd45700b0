"""How a rank builds its model: whole, or without its weights so that it only ever holds
its own shards (fsdp and zero3 with `parallelism.meta_init`, the default there).

- fsdp: the model is built on the meta device (shapes, no storage); FSDP2 shards it; then
  each rank allocates its shards (`to_empty`) and copies its part of each tensor from the
  run's seed weights (runner.models.initial_weights), one tensor at a time.
- zero3: the model is built under DeepSpeed's `zero.Init`, which partitions each
  parameter as soon as its module is built; each rank then copies its partition of each
  parameter from the seed weights, before DeepSpeed makes its optimizer's copies.

Either way the weights are those of a run that built the whole model on every rank.
A model that cannot be built on the meta device (it reads a tensor's values while it is
built, or keeps a tensor that is neither a parameter nor a buffer) is built whole instead,
with a warning in the log that says why: it still trains, at the memory of a whole copy.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner import dist as rdist
from runner.data.splits import Datasets
from runner.engines.base import Fill
from runner.errors import describe
from runner.models.checkpoint_weights import weights_file
from runner.models.initial_weights import build_data_and_model, meta_init_applies
from runner.models.pretrained import Matching, load_into, loaded_tensors, match, unwrapped_name
from runner.models.tensor_files import TensorFile, tensor_file
from runner.spec import RunSpec

log = logging.getLogger(__name__)


def build_for_rank(
    spec: RunSpec, device: str, seed_weights: Path
) -> tuple[Datasets, nn.Module, Fill | None]:
    """The data, the model, and (when built without weights) how to fill in its shards."""
    if meta_init_applies(spec):
        construction = _construction(spec, device)
        try:
            data, module = build_data_and_model(spec, construction)
            _check_no_stray_tensors(module)
        except Exception as exc:
            log.warning(
                "meta_init: %s cannot be built without its weights (%s); every rank builds "
                "the whole model instead",
                spec.model.target,
                describe(exc),
            )
        else:
            zero3 = spec.parallelism.name == "zero3"
            fill = _fill_partitions if zero3 else partial(_fill_shards, device=device)
            log.info("meta_init: each rank holds only its shards from the start")
            sources = InitialWeights(seed_weights, spec.init_from.path, _pretrained(spec, module))
            return data, module, partial(fill, weights=sources)
    data, module = build_data_and_model(spec)
    if spec.init_from.path is not None:
        with weights_file(Path(spec.init_from.path)) as file:
            load_into(module, file, _matching(spec, module, file))
    return data, module.to(device), None


@dataclass
class InitialWeights:
    """Where each tensor's first values come from: the pretrained file (`init_from`) for
    the tensors it matched, else the run's seed weights."""

    seed: Path
    pretrained: str | None = None
    sources: dict[str, str] = field(default_factory=dict)  # model name -> pretrained name

    @contextlib.contextmanager
    def reader(self) -> Iterator[Callable[..., torch.Tensor]]:
        """read(name, start=0, count=None): elements of a tensor, flattened, from its file."""
        with contextlib.ExitStack() as files:
            file = (
                files.enter_context(weights_file(Path(self.pretrained))) if self.sources else None
            )
            seed: TensorFile | None = None  # opened at its first read: init_from may fill all

            def read(name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
                nonlocal seed
                source = self.sources.get(name)
                if source is not None:
                    return file.read(source, start, count)
                if seed is None:
                    seed = files.enter_context(tensor_file(self.seed))
                return seed.read(name, start, count)

            yield read


def _pretrained(spec: RunSpec, module: nn.Module) -> dict[str, str]:
    if spec.init_from.path is None:
        return {}
    with weights_file(Path(spec.init_from.path)) as file:
        return _matching(spec, module, file).sources


def _matching(spec: RunSpec, module: nn.Module, file: TensorFile) -> Matching:
    matching = match(file, loaded_tensors(module), spec.init_from, module)
    problems = matching.problems(spec.init_from)
    if problems:  # the launcher checked the same file; it changed since
        raise ValueError("; ".join(problems))
    log.info("init_from: %s (%s)", spec.init_from.path, matching.summary())
    return matching


def _construction(spec: RunSpec, device: str) -> AbstractContextManager:
    if spec.parallelism.name == "zero3":
        from runner.engines.deepspeed import partitioned_construction

        return partitioned_construction(spec, device)
    return torch.device("meta")


def _check_no_stray_tensors(module: nn.Module) -> None:
    """A tensor kept as a plain attribute would stay on the meta device: refuse it."""
    for name, sub in module.named_modules():
        owned = {id(t) for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False))}
        for attribute, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and value.is_meta and id(value) not in owned:
                where = f"{name}.{attribute}" if name else attribute
                raise ValueError(f"it keeps the tensor {where} outside its parameters and buffers")


def _fill_shards(module: nn.Module, weights: InitialWeights, device: str) -> None:
    """FSDP2: allocate this rank's shards and read into each its rows of the tensor (FSDP2
    shards dim 0, so a shard is one byte range of the file). A tensor that tensor
    parallelism split otherwise (columns, or rows within rows) is read whole, one at a time,
    and this rank's part cut from it in place (no collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    module.to_empty(device=device)
    with torch.no_grad(), weights.reader() as read:
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            key = unwrapped_name(name)
            if not isinstance(tensor, DTensor):
                tensor.copy_(read(key).view(tensor.shape))
                continue
            if not _rows_only(tensor.placements):
                whole = read(key).view(tensor.shape)
                mine = distribute_tensor(
                    whole, tensor.device_mesh, tensor.placements, src_data_rank=None
                )
                tensor.to_local().copy_(mine.to_local())
                continue
            shape, offset = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            row = math.prod(tensor.shape[1:])
            part = read(key, offset[0] * row, math.prod(shape)).view(shape)
            tensor.to_local().copy_(part)


def _rows_only(placements: Any) -> bool:
    """Placements whose local part is one run of whole rows: replicated, or split along dim
    0 once (FSDP2 alone, HSDP)."""
    from torch.distributed.tensor import Shard

    shards = [p for p in placements if not p.is_replicate()]
    return len(shards) <= 1 and all(type(p) is Shard and p.dim == 0 for p in shards)


def _fill_partitions(module: nn.Module, weights: InitialWeights) -> None:
    """ZeRO-3: read into each parameter's partition (`ds_tensor`, this rank's equal part of
    the flattened parameter, the last one padded) its byte range of the seed tensor."""
    rank = rdist.get_global_rank()
    with torch.no_grad(), weights.reader() as read:
        for name, param in module.named_parameters():
            part, key = param.ds_tensor, unwrapped_name(name)
            piece = read(key, rank * part.numel(), part.numel())
            part.zero_()
            part[: piece.numel()].copy_(piece)
            if param.numel():  # kept whole as well (DeepSpeed's persistent parameters)
                param.data.copy_(read(key).view(param.shape))
