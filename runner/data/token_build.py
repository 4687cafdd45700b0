"""Building one token cache: tokenize a corpus's pieces a batch at a time, write tokens
and document starts, sync, and rename the finished directory into place
(runner.data.token_cache says when, under which lock and where).

A build works in `<name>.building-<pid>/` beside the cache's name and removes it when it
fails (a full disk: the error says how much room was left); only a finished, synced
directory ever appears under the name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from runner.data.corpus import read_pieces
from runner.data.token_progress import BuildProgress
from runner.data.tokenizing import Tokenizer
from runner.rundir.files import write_atomic

BATCH_BYTES = 16 << 20  # text handed to the tokenizer at once: 16 pieces for its threads


def build_cache(
    final: Path,
    files: list[Path],
    tokenizer: Tokenizer,
    text_field: str,
    dtype: np.dtype,
    meta: dict[str, Any],
) -> None:
    work = final.with_name(f"{final.name}.building-{os.getpid()}")
    work.mkdir()
    progress = BuildProgress(sum(f.stat().st_size for f in files), final)
    try:
        with open(work / "tokens.bin", "wb") as tokens, open(work / "documents.bin", "wb") as docs:
            writer = _Writer(tokens, docs, tokenizer, dtype, progress)
            for path in files:
                for piece in read_pieces(path, text_field):
                    writer.add(piece)
            writer.flush()
            for f in (tokens, docs):
                f.flush()
                os.fsync(f.fileno())
        meta |= {
            "dtype": dtype.name,
            "vocab_size": tokenizer.vocab_size,
            "separator_length": len(tokenizer.separator),
            "tokens": writer.count,
            "documents": writer.documents,
            "checksum": writer.checksum.hexdigest(),
            "documents_checksum": file_checksum(work / "documents.bin"),  # small: 8 B a document
            "built": {"at": time.time(), "seconds": round(progress.elapsed, 3)},
        }
        write_atomic(work / "meta.json", json.dumps(meta, indent=1) + "\n")
        _fsync_dir(work)
        os.replace(work, final)
        _fsync_dir(final.parent)
    except BaseException as exc:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(exc, OSError):
            free = shutil.disk_usage(final.parent).free
            raise OSError(
                exc.errno,
                f"writing the token cache {final} failed: {exc.strerror or exc} ({free / 1e6:,.0f}"
                " MB free there); nothing was kept. Set data.cache_dir to a disk with room",
            ) from None
        raise
    finally:
        progress.close()
    progress.report(writer.count, writer.documents)


class _Writer:
    """Tokenizes pieces a batch at a time and appends their tokens and document starts."""

    def __init__(self, tokens: Any, docs: Any, tokenizer: Tokenizer, dtype: np.dtype, progress):
        self.tokens, self.docs, self.tokenizer, self.dtype = tokens, docs, tokenizer, dtype
        self.progress = progress
        self.batch: list[Any] = []
        self.batch_bytes = 0
        self.count = self.documents = 0
        self.checksum = hashlib.blake2b(digest_size=16)

    def add(self, piece: Any) -> None:
        self.batch.append(piece)
        self.batch_bytes += piece.size
        if self.batch_bytes >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.batch:
            return
        encoded = self.tokenizer.encode_many([p.text for p in self.batch])
        parts, starts = [], []
        separator = self.tokenizer.separator
        for piece, ids in zip(self.batch, encoded, strict=True):
            if piece.starts:
                if self.documents:
                    parts.append(separator)
                    self.count += len(separator)
                starts.append(self.count)
                self.documents += 1
            parts.append(ids)
            self.count += len(ids)
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if len(flat) and (flat.min() < 0 or flat.max() >= self.tokenizer.vocab_size):
            bad = int(flat.max() if flat.max() >= self.tokenizer.vocab_size else flat.min())
            raise ValueError(
                f"data.tokenizer: {self.tokenizer.description} returned id {bad}, outside its "
                f"vocabulary of {self.tokenizer.vocab_size}"
            )
        data = flat.astype(self.dtype).tobytes()
        self.tokens.write(data)
        self.checksum.update(data)
        self.docs.write(np.asarray(starts, np.uint64).tobytes())
        self.progress.advance(self.batch_bytes)
        self.batch, self.batch_bytes = [], 0


def file_checksum(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
