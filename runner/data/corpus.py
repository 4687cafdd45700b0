"""A text corpus on disk: its files, and the documents in them, read a piece at a time.

Three formats, told by the file's suffix: JSON Lines (`.jsonl`, `.json`: one document per
line, in its `text_field`), Parquet (`.parquet`: one document per row of the `text_field`
column, read a row group at a time with pyarrow) and plain text (anything else: the file
is one document). Nothing here holds more than one piece of one file in memory, so a
corpus of any size streams through the tokenizer.

A plain-text file larger than PIECE_BYTES is handed over in pieces cut just after a newline
that starts a non-blank line. Byte-level BPE tokenizers (GPT-2's and its descendants) cut
their text into words there anyway, so the pieces tokenize as the whole file would.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PIECE_BYTES = 1 << 20
JSON_LINES = (".jsonl", ".json")
PARQUET = (".parquet",)
_BLANK = b" \t\r\n"


@dataclass(frozen=True)
class Piece:
    """Some text of one document: `starts` is True for a document's first piece."""

    text: str | bytes
    starts: bool
    size: int  # bytes of the source it came from (for the progress bar)


def find_files(root: str | Path, pattern: str, skip: Path | None = None) -> list[Path]:
    """The corpus's files, in name order (the order their tokens are stored in); none under
    `skip` (a token cache kept beside the data, data.cache_dir=${data.root}/.cache)."""
    found = sorted(p for p in Path(root).glob(pattern) if p.is_file())
    if skip is None or Path(root) not in skip.parents:
        return found
    return [p for p in found if skip not in p.parents]


def fingerprint(files: list[Path], root: Path) -> list[list]:
    """What the cache key knows of each file: its path under root, size and mtime (ns).
    A file that changes, appears or goes away changes the key."""
    listed = []
    for path in files:
        stat = path.stat()
        listed.append([str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns])
    return listed


def read_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    suffix = path.suffix.lower()
    if suffix in JSON_LINES:
        return _json_lines(path, text_field)
    if suffix in PARQUET:
        return _parquet(path, text_field)
    return _plain_text(path)


def _plain_text(path: Path) -> Iterator[Piece]:
    with open(path, "rb") as f:
        rest, starts = b"", True
        while True:
            chunk = f.read(PIECE_BYTES)
            if not chunk:
                break
            text = rest + chunk
            cut = _cut_point(text)
            if cut == 0:
                rest = text
                continue
            yield Piece(text[:cut], starts, cut)
            rest, starts = text[cut:], False
        if rest or starts:
            yield Piece(rest, starts, len(rest))


def _cut_point(text: bytes) -> int:
    """Just after the last newline that a non-blank byte follows; 0 if there is none."""
    end = len(text) - 1
    while True:
        at = text.rfind(b"\n", 0, end)
        if at < 0:
            return 0
        if text[at + 1] not in _BLANK:
            return at + 1
        end = at


def _json_lines(path: Path, text_field: str) -> Iterator[Piece]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(
                    f"{path}, line {number}: not JSON ({exc}); JSON Lines hold one object a line"
                ) from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                found = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}, line {number}: no text in data.text_field={text_field!r} "
                    f"(the line has {found})"
                )
            yield Piece(text, True, len(line))


def _parquet(path: Path, text_field: str) -> Iterator[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.ParquetFile(path)
    if text_field not in table.schema_arrow.names:
        raise ValueError(
            f"{path}: no column data.text_field={text_field!r}; it has "
            f"{', '.join(table.schema_arrow.names)}"
        )
    total = max(1, os.path.getsize(path))
    rows = max(1, table.metadata.num_rows)
    for group in range(table.num_row_groups):
        column = table.read_row_group(group, columns=[text_field]).column(0)
        for text in column.to_pylist():
            yield Piece(text or "", True, total // rows)
