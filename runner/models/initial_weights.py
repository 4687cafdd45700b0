"""A run's initial weights: one seeded build, the same on every rank and at every layout.

A rank that holds the whole model builds it from the seed (`build_data_and_model`). Under
fsdp and zero3 with `parallelism.meta_init` no rank holds the whole model, so each node's
launcher builds it once on the CPU, before any rank starts, in the same order (seed, data,
model), and writes its tensors to the run directory (`write_seed_weights`): a seed
checkpoint, as torchtitan makes one. Each rank then fills in only its own shards from that
file, one tensor at a time (runner.train.sharded_init). The weights are those of a run
that built the whole model on every rank, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import struct
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from runner.data.datasets import build_datasets
from runner.data.splits import Datasets
from runner.models.builders import build_model
from runner.spec import RunSpec


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
    return data, module


def meta_init_applies(spec: RunSpec) -> bool:
    """Whether the ranks build the model without its weights (fsdp, zero3 with meta_init)."""
    return bool(getattr(spec.parallelism, "meta_init", False))


def seed_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too: a rank has no other source for
    them), by the name the module gives it; a tensor shared under two names once."""
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    return {name: t.detach().contiguous() for name, t in tensors.items()}


def write_seed_weights(spec: RunSpec, path: Path) -> int:
    """Build the model as a rank would and write its tensors to `path` (safetensors),
    atomically: a reader sees the whole file or none. Returns the bytes written."""
    from safetensors.torch import save_file

    _, module = build_data_and_model(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}")
    try:
        save_file(seed_tensors(module), str(partial))
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)  # several nodes on one filesystem: the same bytes, any order
    finally:
        partial.unlink(missing_ok=True)
    return path.stat().st_size


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


class SeedFile:
    """The seed weights, read a byte range at a time with positioned reads: a rank reads
    its own part of a tensor and nothing else. (A memory map would leave every page it
    touched counted in the rank's resident memory.) The safetensors layout: an 8-byte
    little-endian header length, a JSON header of name -> dtype, shape, data_offsets, then
    the data."""

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_RDONLY)
        (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        header = json.loads(os.pread(self._fd, length, 8))
        header.pop("__metadata__", None)
        self._data = 8 + length
        self._entries = header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        """`count` elements of the flattened tensor `name` from element `start` (all of
        it by default), as a new 1-D tensor."""
        entry = self._entries[name]
        dtype = _DTYPES[entry["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        first, end = entry["data_offsets"]
        total = (end - first) // size
        count = total - start if count is None else min(count, total - start)
        out = torch.empty(max(count, 0), dtype=dtype)
        if count > 0:
            view = memoryview(out.view(torch.uint8).numpy())
            offset = self._data + first + start * size
            done = 0
            while done < len(view):
                done += os.preadv(self._fd, [view[done:]], offset + done)
        return out

    def close(self) -> None:
        os.close(self._fd)


@contextlib.contextmanager
def seed_reader(path: Path) -> Iterator[SeedFile]:
    """The seed file, open for positioned reads while the context lasts."""
    seed = SeedFile(path)
    try:
        yield seed
    finally:
        seed.close()
