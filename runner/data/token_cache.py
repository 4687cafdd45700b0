"""The token cache: a corpus tokenized once, stored flat, and read by every process.

One cache is a directory under the cache root (`data.cache_dir`, else RUNNER_CACHE_DIR,
else ~/.cache/runner), named after the corpus folder and a content key:

    tokens.bin      every document's tokens, uint16 (uint32 past 65,536 ids), with the
                    tokenizer's separator (runner.data.tokenizing) between documents
    documents.bin   uint64: where each document starts in tokens.bin
    meta.json       format, key, dtype, counts, the files, the tokenizer, checksums
    verified.json   the data files' sizes and modification times when last verified whole:
                    a file written into since (truncated, or bytes changed in place) is read
                    back against its checksum before it is served, and rebuilt if it differs
    pieces-B.bin    (made when first asked) documents cut into blocks of B tokens

The key hashes each file's path under the root, size and modification time, the
tokenizer's identity, the text field and the format version: a changed, added or removed
file, or another tokenizer, is another key, so stale tokens are never served.

Concurrent runs agree through an exclusive lock (flock) on `<name>.lock` beside it: one
process builds, into `<name>.building-<pid>`, and the others wait. The directory appears
under its name by one rename, after every file in it is complete and synced: a cache that
exists is finished. A build that is killed leaves only its `.building-` directory, which
the next builder removes; a build that fails (a full disk) removes its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runner.data.corpus import find_files, fingerprint
from runner.data.token_build import build_cache, file_checksum
from runner.data.tokenizing import Tokenizer
from runner.rundir.files import file_lock, read_json, write_atomic

FORMAT = 1
VERIFIED = "verified.json"  # the data files' sizes and times when last verified whole
CACHE_ENV = "RUNNER_CACHE_DIR"
log = logging.getLogger("runner")


class CacheDamaged(Exception):
    """A finished cache whose files disagree with its meta.json (truncated, replaced)."""


def cache_root(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser().resolve()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "runner"


def token_dtype(vocab_size: int, wanted: str = "auto") -> np.dtype:
    """uint16 while every id fits (nanoGPT's choice: half the bytes), else uint32."""
    if wanted not in ("auto", "uint16", "uint32"):
        raise ValueError(f"data.token_dtype={wanted!r}: valid: auto, uint16, uint32")
    if wanted == "uint16" and vocab_size > 1 << 16:
        raise ValueError(
            f"data.token_dtype=uint16: the tokenizer has {vocab_size:,} ids, more than uint16 "
            "holds (65,536); valid here: auto, uint32"
        )
    if vocab_size > 1 << 32:
        raise ValueError(f"data.tokenizer: {vocab_size:,} ids do not fit in uint32")
    return np.dtype(np.uint32 if wanted == "uint32" or vocab_size > 1 << 16 else np.uint16)


@dataclass(frozen=True)
class TokenCache:
    path: Path
    meta: dict[str, Any]

    @property
    def tokens_file(self) -> Path:
        return self.path / "tokens.bin"

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def tokens(self) -> int:
        return int(self.meta["tokens"])

    @property
    def documents(self) -> int:
        return int(self.meta["documents"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def __str__(self) -> str:
        return f"token cache {self.path} ({self.tokens:,} tokens, {self.dtype.name})"

    def pieces(self, block_size: int) -> np.ndarray:
        """Documents cut into blocks of at most `block_size` tokens, as (start, length) rows
        (data.pack=false), built once per block size and memory-mapped."""
        path = self.path / f"pieces-{block_size}.bin"
        if not path.exists():
            with file_lock(self.path.parent / f"{self.path.name}.lock"):
                if not path.exists():
                    write_atomic(path, _cut_documents(self, block_size).tobytes())
        return np.memmap(path, dtype=np.int64, mode="r").reshape(-1, 2)

    def check(self) -> None:
        """The files are the sizes meta.json says (cheap: no token is read)."""
        expected = {
            "tokens.bin": self.tokens * self.dtype.itemsize,
            "documents.bin": self.documents * 8,
        }
        for name, size in expected.items():
            path = self.path / name
            actual = path.stat().st_size if path.exists() else None
            if actual != size:
                found = "is missing" if actual is None else f"has {actual:,} bytes"
                raise CacheDamaged(f"{path} {found}; its meta.json says {size:,}")

    def verify(self) -> None:
        """Every token against the checksum taken when it was written (reads them all), and
        the document starts against theirs (caches built since it was kept)."""
        self.check()
        if file_checksum(self.tokens_file) != self.meta["checksum"]:
            raise CacheDamaged(f"{self.tokens_file}: its checksum differs from meta.json's")
        documents = self.path / "documents.bin"
        expected = self.meta.get("documents_checksum")
        if expected is not None and file_checksum(documents) != expected:
            raise CacheDamaged(f"{documents}: its checksum differs from meta.json's")

    def signature(self) -> dict[str, list[int]]:
        """Each data file's size and modification time: what a write into it changes."""
        stats = {name: (self.path / name).stat() for name in ("tokens.bin", "documents.bin")}
        return {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}

    def unchanged(self) -> bool:
        """Whether the files are as they were when last verified whole (cheap: two stats).
        A file written into since (even at the same size) is read back in full first."""
        return read_json(self.path / VERIFIED) == self.signature()

    def stamp(self) -> None:
        """Note that the files, as they are now, were verified whole."""
        write_atomic(self.path / VERIFIED, json.dumps(self.signature()) + "\n")


def _cut_documents(cache: TokenCache, block_size: int) -> np.ndarray:
    starts = np.fromfile(cache.path / "documents.bin", dtype=np.uint64).astype(np.int64)
    gap = int(cache.meta["separator_length"])
    ends = np.append(starts[1:] - gap, cache.tokens)
    lengths = ends - starts
    counts = -(-lengths // block_size)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    doc = np.repeat(np.arange(len(starts)), counts)
    offset = (np.arange(int(counts.sum())) - first) * block_size
    return np.stack([starts[doc] + offset, np.minimum(block_size, lengths[doc] - offset)], 1)


def cache_key(listing: list[list], tokenizer: Tokenizer, text_field: str, dtype: np.dtype) -> str:
    content = {
        "format": FORMAT,
        "files": listing,
        "tokenizer": tokenizer.identity,
        "text_field": text_field,
        "dtype": dtype.name,
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def open_cache(
    root: str | Path,
    pattern: str,
    tokenizer: Tokenizer,
    text_field: str = "text",
    cache_dir: str | None = None,
    dtype: str = "auto",
    rebuild: bool = False,
) -> TokenCache:
    """The finished cache of this corpus and tokenizer, built first if there is none (or it
    is damaged, or `rebuild`). Safe to call from many processes at once."""
    root = Path(root).expanduser().resolve()
    where = cache_root(cache_dir)
    if where == root:
        raise ValueError(
            f"data.cache_dir={str(where)!r}: the corpus folder itself; use a folder of its own, "
            "such as ${data.root}/.runner-cache"
        )
    files = find_files(root, pattern, skip=where)
    if not files:
        raise ValueError(f"data.root={str(root)!r}: no file matches data.pattern={pattern!r}")
    chosen = token_dtype(tokenizer.vocab_size, dtype)
    listing = fingerprint(files, root)
    key = cache_key(listing, tokenizer, text_field, chosen)
    name = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', root.name) or 'corpus'}-{key[:16]}"
    final = where / name
    if not rebuild:
        found = _open_finished(final, repair=False)
        if found is not None:
            return found
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = final.parent / f"{name}.lock"

    def waiting(holder: str) -> None:
        log.info("runner: waiting for %s to finish building %s", holder, final)

    with file_lock(lock, on_wait=waiting):
        if rebuild:
            _remove(final)
            rebuild = False
        found = _open_finished(final, repair=True)
        if found is not None:  # another process built it while this one waited
            return found
        for stale in final.parent.glob(f"{name}.building-*"):  # a killed build's
            log.info("runner: removing %s (a build that did not finish)", stale)
            shutil.rmtree(stale, ignore_errors=True)
        meta = {"format": FORMAT, "key": key, "root": str(root), "files": listing}
        meta |= {"text_field": text_field, "tokenizer": tokenizer.description}
        build_cache(final, files, tokenizer, text_field, chosen, meta)
        built = TokenCache(final, json.loads((final / "meta.json").read_text()))
        built.stamp()  # checksummed as it was written
    return built


def _open_finished(final: Path, repair: bool) -> TokenCache | None:
    """The cache if it is there and whole; a damaged one is removed when `repair` (only
    under the lock: never a cache another process is building)."""
    try:
        cache = TokenCache(final, json.loads((final / "meta.json").read_text()))
        cache.check()
        if not cache.unchanged():  # written into since it was verified: read it all, once
            if not repair:
                return None  # verified under the lock
            cache.verify()
            cache.stamp()
    except FileNotFoundError:
        return None
    except (CacheDamaged, ValueError, KeyError) as exc:
        if repair:
            log.warning("runner: the token cache is damaged (%s); building it again", exc)
            _remove(final)
        return None
    return cache


def _remove(final: Path) -> None:
    """Out of the way by one rename (a reader of it keeps its open files), then deleted."""
    doomed = final.with_name(f"{final.name}.building-removed-{os.getpid()}")
    try:
        os.replace(final, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)
