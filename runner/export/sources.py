"""Where `runner export` finds a run's weights, as whole tensors read one at a time.

- a run directory's `model.pt` (a finished run), or a model.pt given itself;
- a checkpoint (`checkpoints/step_N`, or a run directory without model.pt: its latest),
  whatever wrote it: ddp's `state.pt` (memory-mapped), fsdp's torch.distributed.checkpoint
  shards (each tensor assembled from its shards by DCP's reader, one at a time), or
  DeepSpeed's ZeRO-1/2/3 partitions (its `zero_to_fp32` in lazy mode: each fp32 tensor
  merged from the ranks' partitions when it is asked for).

Names are the model's own, without the wrappers runner adds (activation checkpointing,
compile), so they match the model a Hugging Face config builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.models.pretrained import unwrapped_name
from runner.models.safetensors_out import OutTensor, torch_file_tensors
from runner.models.tensor_files import TorchFile
from runner.rundir.checkpoints import resolve_checkpoint_path


class NoWeights(ValueError):
    """A path that holds no model.pt and no checkpoint."""


@dataclass
class RunWeights:
    """A run's weights, ready to be written: where they came from, the run's directory
    (its config.yaml), and each tensor."""

    source: Path
    run_dir: Path
    tensors: list[OutTensor]
    _keep: list[Any] = field(default_factory=list)  # readers the tensors read through


def find_weights(path: Path) -> RunWeights:
    path = path.expanduser().resolve()
    if path.is_file() and path.suffix in (".pt", ".pth", ".bin"):
        return _torch_file(path, path.parent, key=None)
    if (path / "model.pt").is_file():
        return _torch_file(path / "model.pt", path, key=None)
    checkpoint = resolve_checkpoint_path(path) if path.is_dir() else None
    if checkpoint is None:
        raise NoWeights(
            f"{path}: no model.pt and no complete checkpoint (give a run directory, a "
            "checkpoints/step_N directory or a model.pt)"
        )
    run_dir = checkpoint.parent.parent  # RUN/checkpoints/step_N
    if (checkpoint / "state.pt").is_file():
        return _torch_file(checkpoint / "state.pt", run_dir, key="model", source=checkpoint)
    if (checkpoint / "dcp").is_dir():
        return _dcp(checkpoint, run_dir)
    if (checkpoint / "latest").is_file():
        return _deepspeed(checkpoint, run_dir)
    raise NoWeights(f"{checkpoint}: a checkpoint of a kind runner does not know")


def _tensor(name: str, value_shape: Any, dtype: torch.dtype, read: Callable) -> OutTensor:
    return OutTensor(unwrapped_name(name), tuple(value_shape), dtype, read)


def _torch_file(
    file: Path, run_dir: Path, key: str | None, source: Path | None = None
) -> RunWeights:
    """Memory-mapped; each tensor copied out and its pages handed back as it is written."""
    reader = TorchFile(file, key=key, weights_only=key is None)
    return RunWeights(source or file, run_dir, torch_file_tensors(reader, unwrapped_name), [reader])


def _dcp(checkpoint: Path, run_dir: Path) -> RunWeights:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint / "dcp"))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = []
    for key, entry in metadata.items():
        if not key.startswith("model.") or not isinstance(entry, TensorStorageMetadata):
            continue
        name = key[len("model.") :]
        dtype = entry.properties.dtype

        def read(name: str = name, shape: Any = entry.size, dtype: torch.dtype = dtype):
            value = torch.empty(tuple(shape), dtype=dtype)
            dcp.load({"model": {name: value}}, storage_reader=reader, no_dist=True)
            return value

        tensors.append(_tensor(name, entry.size, dtype, read))
    return RunWeights(checkpoint, run_dir, tensors, [reader])


def _deepspeed(checkpoint: Path, run_dir: Path) -> RunWeights:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = (checkpoint / "latest").read_text().strip()
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag, lazy_mode=True)
    tensors = [
        _tensor(name, value.shape, value.dtype, lambda v=value: v.contiguous())
        for name, value in lazy.items()
    ]
    return RunWeights(checkpoint, run_dir, tensors, [lazy])
