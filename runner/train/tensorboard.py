"""TensorBoard event files, written directly (no tensorflow, tensorboard or torch import).

The format is a sequence of TFRecords, each holding a serialized `Event`
protocol buffer. Only the few fields a scalar needs are encoded by hand:

    TFRecord: uint64 length | uint32 masked crc32c(length) | data | uint32 masked crc32c(data)
    Event:    1 wall_time (double) | 2 step (int64) | 3 file_version (string) | 5 summary
    Summary:  1 value (repeated)   Value: 1 tag (string) | 2 simple_value (float)

`tensorboard --logdir runs/` reads them like any other event file (tested with
tensorboard's own reader).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Any, BinaryIO

_CRC_TABLE: list[int] = []


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord uses; table-driven, records are small."""
    if not _CRC_TABLE:
        for byte in range(256):
            crc = byte
            for _ in range(8):
                crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
            _CRC_TABLE.append(crc)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> bytes:
    crc = _crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 as protobuf encodes it
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (strings and messages)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + body


def _scalars(values: dict[str, float]) -> bytes:
    encoded = b"".join(
        _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
        for tag, value in values.items()
    )
    return _field(5, encoded)


class EventWriter:
    """Scalars of each logged step into `directory/events.out.tfevents.*` (rank 0 only)."""

    def __init__(self, directory: Path, records: list[dict[str, Any]]):
        """Start a fresh event file holding `records` (what metrics.jsonl kept on a resume),
        so TensorBoard never shows steps that a resumed run trained again."""
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("events.out.tfevents.*"):
            old.unlink()
        now = time.time()
        self.path = directory / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.runner"
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115
        self._write(_event(now, 0, _field(3, b"brain.Event:2")))
        for record in records:
            self.add(record, flush=False)
        self._file.flush()

    def add(self, record: dict[str, Any], flush: bool = True) -> None:
        """Every numeric value of a metrics record, at the record's step."""
        values = {
            key: float(value)
            for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if values:
            self._write(_event(time.time(), int(record.get("step", 0)), _scalars(values)))
        if flush:
            self._file.flush()

    def _write(self, data: bytes) -> None:
        length = struct.pack("<Q", len(data))
        self._file.write(length + _masked_crc(length) + data + _masked_crc(data))

    def close(self) -> None:
        self._file.close()
