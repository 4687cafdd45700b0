"""A run's weights wherever they are, as whole tensors read one at a time: what `runner
export` writes, and what `init_from` (and so `runner eval`) reads from a checkpoint.

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

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.models.pretrained import unwrapped_name
from runner.models.safetensors_out import OutTensor, torch_file_tensors
from runner.models.tensor_files import (
    TensorFile,
    TorchFile,
    WeightsFileError,
    open_tensor_file,
    tensor_file,
)
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


class CheckpointFile:
    """A checkpoint's weights as a TensorFile (init_from): each tensor read whole, once per
    `read` (a rank that wants a shard of it slices the whole)."""

    def __init__(self, weights: RunWeights):
        self.weights = weights
        self._tensors = {t.name: t for t in weights.tensors}

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        flat = self._tensors[name].values().reshape(-1)
        end = flat.numel() if count is None else min(start + count, flat.numel())
        return flat[start:end].clone() if (start, end) != (0, flat.numel()) else flat

    def close(self) -> None:
        self._tensors.clear()
        self.weights._keep.clear()


def open_weights(path: Path) -> TensorFile:
    """The reader for init_from's `path`: a weights file or a directory holding one
    (runner.models.tensor_files), else a checkpoint, or a run directory's latest."""
    try:
        return open_tensor_file(path)
    except WeightsFileError:
        if not path.is_dir() or resolve_checkpoint_path(path) is None:
            raise
    try:
        return CheckpointFile(find_weights(path))
    except NoWeights as exc:
        raise WeightsFileError(str(exc)) from None


def weights_file(path: Path) -> contextlib.AbstractContextManager[TensorFile]:
    """`path`'s reader (open_weights), open while the context lasts; it also reads the
    stacked sources init_from matches (runner.models.stacked_experts)."""
    from runner.models.stacked_experts import StackedReads

    return tensor_file(path, lambda p: StackedReads(open_weights(p)))


def find_weights(path: Path) -> RunWeights:
    path = path.expanduser().resolve()
    if not path.exists():
        raise NoWeights(f"{path}: no such file or directory")
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
            with warnings.catch_warnings():  # one process on purpose (no_dist): torch says
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load")
                dcp.load({"model": {name: value}}, storage_reader=reader, no_dist=True)
            return value

        tensors.append(_tensor(name, entry.size, dtype, read))
    return RunWeights(checkpoint, run_dir, tensors, [reader])


def _deepspeed(checkpoint: Path, run_dir: Path) -> RunWeights:
    from runner.processes import without_mlflow

    with without_mlflow():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = (checkpoint / "latest").read_text().strip()
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag, lazy_mode=True)
    tensors = [
        _tensor(name, value.shape, value.dtype, lambda v=value: v.contiguous())
        for name, value in lazy.items()
    ]
    return RunWeights(checkpoint, run_dir, tensors, [lazy])
