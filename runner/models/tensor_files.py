"""Tensors read from weight files a piece at a time: the seed weights a launcher writes,
and the pretrained weights a run starts from (`init_from`).

A reader names each tensor, gives its shape, and reads any run of its flattened elements
(`read(name, start, count)`), so a rank reads its own shard of a tensor and nothing else.

- safetensors: positioned reads from the file (a memory map would leave every page it
  touched counted in the rank's resident memory);
- a directory of safetensors files with their index (`model.safetensors.index.json`'s
  `weight_map`, as Hugging Face shards a checkpoint);
- a `torch.save`d state_dict (runner's model.pt, a `pytorch_model.bin`): loaded
  memory-mapped (`torch.load(mmap=True, weights_only=True)`), read by slicing.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

import torch

FORMATS = (
    "a model.pt (or another torch.save'd state_dict), a .safetensors file, a directory of "
    "sharded .safetensors files with their index, or a local Hugging Face model directory"
)
INDEX = "model.safetensors.index.json"
# safetensors' dtype names, both ways (read here, written by runner.models.safetensors_out)
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip
SAFETENSORS_DTYPES = {dtype: name for name, dtype in _DTYPES.items()}


class WeightsFileError(ValueError):
    """A path that is not a weights file runner reads, or one it cannot read (the message
    says why; the caller names the path)."""


class TensorFile(Protocol):
    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        """`count` elements of the flattened tensor `name` from element `start` (all of it
        by default), as a 1-D tensor of the file's dtype."""
        ...

    def close(self) -> None: ...


class SafetensorsFile:
    """One safetensors file: an 8-byte little-endian header length, a JSON header of
    name -> dtype, shape, data_offsets, then the data."""

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if length > os.fstat(self._fd).st_size:
                raise ValueError("its header is longer than the file")
            header = json.loads(os.pread(self._fd, length, 8))
            header.pop("__metadata__", None)
            unknown = {e["dtype"] for e in header.values()} - _DTYPES.keys()
        except (ValueError, struct.error, KeyError, TypeError, AttributeError) as exc:
            os.close(self._fd)
            raise WeightsFileError(f"not a readable safetensors file ({exc})") from exc
        if unknown:
            os.close(self._fd)
            raise WeightsFileError(f"holds tensors of dtype {sorted(unknown)}, unread")
        self._data = 8 + length
        self._entries = header

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
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


class ShardedSafetensors:
    """Safetensors files named by an index's `weight_map` (tensor name -> file)."""

    def __init__(self, index: Path):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: index.parent / file for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsFileError(f"{index.name}: not a safetensors index ({exc})") from exc
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise WeightsFileError(f"{index.name} names {absent[0]}, which does not exist")
        self._shards: dict[Path, SafetensorsFile] = {}
        try:
            for file in dict.fromkeys(files.values()):
                self._shards[file] = _shard(file)
        except WeightsFileError:
            self.close()
            raise
        self._where = {name: self._shards[file] for name, file in files.items()}

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        return self._where[name].read(name, start, count)

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()


def _shard(file: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(file)
    except WeightsFileError as exc:
        raise WeightsFileError(f"its shard {file.name}: {exc}") from exc


class TorchFile:
    """A state_dict saved with torch.save, memory-mapped: nothing is read until sliced, and
    the pages a read touched are handed back once it is copied out (a mapped page counts in
    the process's resident memory for as long as it stays mapped). `key`: the state_dict
    under that key of a larger checkpoint (ddp's state.pt, which needs `weights_only=False`)."""

    def __init__(self, path: Path, key: str | None = None, weights_only: bool = True):
        try:
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        except Exception as exc:
            raise WeightsFileError(f"torch.load cannot read it ({exc})") from exc
        if key is not None and isinstance(loaded, Mapping):
            loaded = loaded.get(key)
        if not isinstance(loaded, Mapping) or not all(
            isinstance(v, torch.Tensor) for v in loaded.values()
        ):
            raise WeightsFileError(f"holds a {type(loaded).__name__}, not a state_dict of tensors")
        self._tensors = dict(loaded)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name].dtype

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        flat = self._tensors[name].reshape(-1)
        end = flat.numel() if count is None else min(start + count, flat.numel())
        piece = flat[start:end]
        out = piece.clone()
        _unmap_pages(piece)
        return out

    def close(self) -> None:
        self._tensors.clear()


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4  # Linux's value


def _unmap_pages(tensor: torch.Tensor) -> None:
    """Drop the whole pages under `tensor` from this process's resident memory. They are
    clean pages of a private file mapping (torch.load's mmap): touched again, they are read
    from the file again. Linux only; elsewhere the kernel reclaims them under pressure."""
    if not sys.platform.startswith("linux") or tensor.numel() == 0:
        return
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    first = -(-begin // _PAGE) * _PAGE  # whole pages only: a neighbour's page stays
    last = end // _PAGE * _PAGE
    if last > first:
        size = ctypes.c_size_t(last - first)
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), size, _MADV_DONTNEED)


def open_tensor_file(path: Path) -> TensorFile:
    """The reader for `path`: a file, or a directory holding one (Hugging Face's layout,
    or a run directory's model.pt)."""
    if path.is_dir():
        for name in (INDEX, "model.safetensors", "model.pt", "pytorch_model.bin"):
            if (path / name).is_file():
                return open_tensor_file(path / name)
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if len(indexes) == 1:
            return ShardedSafetensors(indexes[0])
        raise WeightsFileError(f"a directory with no {INDEX}, model.safetensors or model.pt in it")
    if not path.is_file():
        raise WeightsFileError("no such file or directory")
    if path.name.endswith(".index.json"):
        return ShardedSafetensors(path)
    if path.suffix == ".safetensors":
        return SafetensorsFile(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":  # torch.save's zip archive
        raise WeightsFileError(f"neither safetensors nor a torch.save file; give {FORMATS}")
    return TorchFile(path)


@contextlib.contextmanager
def tensor_file(
    path: Path, opener: Callable[[Path], TensorFile] = open_tensor_file
) -> Iterator[TensorFile]:
    """`path`'s reader (`opener`'s), open while the context lasts."""
    file = opener(path)
    try:
        yield file
    finally:
        file.close()
