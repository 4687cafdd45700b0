"""Read a W&B run's transaction log (run-<id>.wandb) with wandb's own record protobufs.

The file is a LevelDB-style log (github.com/google/leveldb doc/log_format.md): a 7-byte
header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of chunks, each chunk a CRC-32,
a length, a type (full, first, middle, last) and its bytes. wandb 0.31 reads it only in its
Go core, so the framing is read here; the records are wandb.proto's `Record`.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path}: not a W&B transaction log"
    offset, pending = 7, b""
    while offset + CHUNK_HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < CHUNK_HEADER:  # a block's zero trailer
            offset += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[offset : offset + CHUNK_HEADER])
        body = data[offset + CHUNK_HEADER : offset + CHUNK_HEADER + length]
        if kind == 0 and length == 0:  # zero padding at the end
            break
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad CRC at {offset}"
        offset += CHUNK_HEADER + length
        pending = body if kind in (FULL, FIRST) else pending + body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(path: Path) -> list[dict[str, Any]]:
    """The rows logged with run.log, each with its `_step`."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append(row)
    return rows


def summary(path: Path) -> dict[str, Any]:
    """The run's summary: every summary record's updates, in order."""
    merged: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                merged[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return merged
