"""Safetensors files written one tensor at a time, in shards above a size, with the index
Hugging Face's `from_pretrained` reads (`model.safetensors.index.json`).

The header of a safetensors file needs only each tensor's name, dtype and shape, so it is
written first and every tensor's bytes after it as they come: the writer holds one tensor
at a time, never the model. Files appear under their names only once whole: each is
written to a hidden temporary beside it and renamed, the index (or the single file) last.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from runner.models.tensor_files import SAFETENSORS_DTYPES, TorchFile

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class OutTensor:
    """One tensor to write: its name, shape and dtype up front, its values when asked."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors(
    directory: Path, tensors: list[OutTensor], max_shard_bytes: int
) -> list[Path]:
    """Write `tensors` into `directory` as model.safetensors, or, when they add up to more
    than `max_shard_bytes`, as model-0000i-of-0000n.safetensors with the index. Returns the
    files written, the index last."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = _group_into_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = []
    for name, shard in zip(names, shards, strict=True):
        write_file(directory / name, shard)
        written.append(directory / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {
                t.name: n for n, shard in zip(names, shards, strict=True) for t in shard
            },
        }
        replace_with(directory / INDEX, json.dumps(index, indent=2).encode())
        written.append(directory / INDEX)
    return written


def _group_into_shards(tensors: list[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def _header(tensors: list[OutTensor]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}  # transformers checks it
    offset = 0
    for tensor in tensors:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{tensor.name}: dtype {tensor.dtype} has no safetensors name")
        end = offset + tensor.nbytes
        entries[tensor.name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)  # the data starts 8-byte aligned


def write_file(path: Path, tensors: list[OutTensor]) -> None:
    """One safetensors file, whole or not at all (several nodes may write the same path on
    one filesystem: each its own temporary)."""
    temporary = path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}.partial")
    try:
        with open(temporary, "wb") as f:
            header = _header(tensors)
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for tensor in tensors:
                f.write(_bytes(tensor))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _bytes(tensor: OutTensor) -> memoryview:
    value = tensor.values().detach().to("cpu", tensor.dtype).contiguous()
    if tuple(value.shape) != tensor.shape:
        raise ValueError(f"{tensor.name}: shape {tuple(value.shape)}, announced {tensor.shape}")
    return memoryview(value.reshape(-1).view(torch.uint8).numpy())


def replace_with(path: Path, content: bytes) -> None:
    """Write `path` whole or not at all (a hidden temporary beside it, renamed)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        temporary.write_bytes(content)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def torch_file_tensors(reader: TorchFile, name_of: Callable[[str], str] = str) -> list[OutTensor]:
    """A memory-mapped torch file's tensors, each read (and its pages handed back) when
    it is written; `name_of` renames them."""
    return [
        OutTensor(name_of(n), reader.shape(n), reader.dtype(n), partial(_whole, reader, n))
        for n in reader.names()
    ]


def _whole(reader: TorchFile, name: str) -> torch.Tensor:
    return reader.read(name).view(reader.shape(name))


def safetensors_beside(model_pt: Path) -> Path:
    """model.safetensors next to a model.pt: the same tensors in the safe format (no
    pickle), copied one at a time."""
    reader = TorchFile(model_pt)
    try:
        (written,) = write_safetensors(model_pt.parent, torch_file_tensors(reader), sys.maxsize)
    finally:
        reader.close()
    return written
