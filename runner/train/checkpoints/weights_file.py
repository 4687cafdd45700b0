"""model.pt written one tensor at a time: no rank ever holds the whole model to write it.

The file is the one `torch.save(state_dict)` writes (a zip archive: the pickle, then one
record per tensor), so `torch.load` reads it as ever. It is made in two passes:

1. rank 0 lays the archive out with torch.save itself, over FakeTensors (shapes and dtypes,
   no memory) and under `torch.serialization.skip_data`, which reserves each tensor's
   record without writing its bytes;
2. tensor by tensor, every rank takes part in gathering it (an all-gather of FSDP's shards,
   of ZeRO's partitions) and rank 0 writes it into its record, with the record's CRC-32,
   then drops it before the next.

Rank 0's memory for model.pt is then one whole tensor, not the whole model (and not the
two or three copies that gathering a state_dict and serializing it into memory cost).
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from runner import dist as rdist
from runner.engines.base import FinalTensor
from runner.rundir.files import replacing

LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip's local file header (30 bytes)
CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")  # a central directory entry (46 bytes)
CENTRAL_SIGNATURE = b"PK\x01\x02"
CRC_AT_LOCAL, CRC_AT_CENTRAL = 14, 16  # where each header holds its record's CRC-32


def write_weights(path: Path, tensors: Sequence[FinalTensor]) -> None:
    """Every rank, with the same `tensors` in the same order: gather each; rank 0 writes
    them into `path` (a temporary beside it until the last is in, then renamed)."""
    if rdist.get_global_rank() != 0:
        for entry in tensors:
            entry.gather()
        return
    with replacing(path) as tmp:
        records, directory = lay_out(tmp, tensors)
        crcs = []
        with open(tmp, "r+b") as f:
            for entry, record in zip(tensors, records, strict=True):
                data = _bytes(entry)
                f.seek(_data_offset(f, record))
                f.write(data)
                crcs.append(zlib.crc32(data))
                del data
            _set_crcs(f, records, directory, crcs)


def lay_out(path: Path, tensors: Sequence[FinalTensor]) -> tuple[list[zipfile.ZipInfo], int]:
    """Write the archive with every record reserved; return each tensor's record and where
    the archive's central directory starts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        skeleton = {t.name: torch.empty(t.shape, dtype=t.dtype) for t in tensors}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, path)
    with zipfile.ZipFile(path) as archive:
        records = {  # torch.save numbers storages data/0, data/1, ... in the order it meets them
            int(info.filename.rsplit("/", 1)[1]): info
            for info in archive.infolist()
            if info.filename.rsplit("/", 2)[-2:-1] == ["data"]
        }
        directory = archive.start_dir
    if sorted(records) != list(range(len(tensors))):
        raise RuntimeError(
            f"model.pt: torch.save laid out {len(records)} tensor records for "
            f"{len(tensors)} tensors"
        )
    for key, entry in enumerate(tensors):
        nbytes = entry.shape.numel() * entry.dtype.itemsize
        if records[key].file_size != nbytes:
            raise RuntimeError(
                f"model.pt: record {key} holds {records[key].file_size} bytes, {entry.name} "
                f"{nbytes}"
            )
    return [records[key] for key in range(len(tensors))], directory


def _data_offset(f: BinaryIO, record: zipfile.ZipInfo) -> int:
    """Where the record's bytes start: after its local header, name and extra field."""
    f.seek(record.header_offset)
    fields = LOCAL_HEADER.unpack(f.read(LOCAL_HEADER.size))
    name_length, extra_length = fields[-2], fields[-1]
    return record.header_offset + LOCAL_HEADER.size + name_length + extra_length


def _bytes(entry: FinalTensor) -> memoryview:
    """The gathered tensor's bytes, on the CPU, in the dtype and shape laid out for it."""
    value = entry.gather()
    if value is None or tuple(value.shape) != tuple(entry.shape):
        got = None if value is None else tuple(value.shape)
        raise RuntimeError(f"model.pt: {entry.name} gathered as {got}, laid out {entry.shape}")
    value = value.detach().to(device="cpu", dtype=entry.dtype).contiguous()
    return memoryview(value.reshape(-1).view(torch.uint8).numpy())


def _set_crcs(f: BinaryIO, records: list[zipfile.ZipInfo], directory: int, crcs: list[int]) -> None:
    """Put each tensor record's CRC-32 into its local header and its central directory
    entry (skip_data leaves them 0), so that the archive checks out whole."""
    crc_of = {record.filename: crc for record, crc in zip(records, crcs, strict=True)}
    for record in records:
        f.seek(record.header_offset + CRC_AT_LOCAL)
        f.write(struct.pack("<L", crc_of[record.filename]))
    position = directory
    while True:
        f.seek(position)
        fields = CENTRAL_HEADER.unpack(f.read(CENTRAL_HEADER.size))
        if fields[0] != CENTRAL_SIGNATURE:  # past the last entry: the directory's end record
            return
        name_length, extra_length, comment_length = fields[12], fields[13], fields[14]
        name = f.read(name_length).decode()
        if name in crc_of:
            f.seek(position + CRC_AT_CENTRAL)
            f.write(struct.pack("<L", crc_of[name]))
        position += CENTRAL_HEADER.size + name_length + extra_length + comment_length
