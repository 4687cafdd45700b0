"""Text files as language-model data: `data=text`, the files under `data.root`.

The files matching `pattern` (plain text, JSON Lines, Parquet: runner.data.corpus) are
tokenized once into a token cache (runner.data.token_cache) that every process reads; no
process holds the corpus. Samples are blocks of `block_size` tokens, `{"input_ids",
"labels"}` (the loss shifts the labels); the last `val_fraction` of them validates.

`pack=true` (nanoGPT's way) cuts the whole token stream into blocks, across document
boundaries: no token is padding. `pack=false` cuts each document on its own, so a block
never spans two documents; a document's last block is shorter and batches are padded
(labels -100, attention_mask 0).

`min_length` makes packed samples ragged: each block is cut to a fixed pseudo-random
length between min_length and block_size (a function of its index, so it costs no memory):
the batches of different lengths a real corpus of documents gives.

Samples are read with positioned reads (pread) from the cache's files: the page cache
serves them, nothing is mapped or copied per rank, and a rank's resident memory does not
grow with the corpus, even after an epoch over all of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from runner.data.splits import Datasets
from runner.data.token_cache import TokenCache, open_cache
from runner.data.tokenizing import ByteTokenizer, load_tokenizer

IGNORE_INDEX = -100
_MASK = (1 << 64) - 1

__all__ = ["ByteTokenizer", "PadCollate", "TokenBlocks", "TokenPieces", "prepare", "text_files"]


class _TokenReader:
    """Reads token ranges from a cache's tokens.bin; the file opens once per process (so a
    dataset pickles into DataLoader workers, and a fork gets its own descriptor)."""

    draws_nothing = True  # no random draw per sample: the loader need not seed each one

    def __init__(self, cache: TokenCache, block_size: int, first: int, count: int):
        self.path, self.dtype = str(cache.tokens_file), cache.dtype
        self.block_size, self.first, self.count = block_size, first, count
        self._fd: tuple[int, int] | None = None  # (pid, descriptor)

    def __len__(self) -> int:
        return self.count

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}

    def _read(self, start: int, length: int) -> bytes:
        if self._fd is None or self._fd[0] != os.getpid():
            self._fd = (os.getpid(), os.open(self.path, os.O_RDONLY))
        size = self.dtype.itemsize
        return os.pread(self._fd[1], length * size, start * size)

    def _index(self, index: int) -> int:
        if not -self.count <= index < self.count:
            raise IndexError(f"sample {index} of {self.count}")
        return self.first + index % self.count

    def _sample(self, ids: np.ndarray) -> dict[str, Any]:
        import torch

        tensor = torch.from_numpy(ids.astype(np.int64))
        return {"input_ids": tensor, "labels": tensor}


class TokenBlocks(_TokenReader):
    """Consecutive blocks of the token stream (pack=true); cut to a pseudo-random length
    per block when `min_length` is set."""

    def __init__(self, cache: TokenCache, block_size: int, first: int, count: int, min_length=None):
        super().__init__(cache, block_size, first, count)
        self.min_length = min_length

    def length(self, block: int) -> int:
        if self.min_length is None:
            return self.block_size
        x = (block + 0x9E3779B97F4A7C15) & _MASK  # splitmix64: a fixed length per block
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        return self.min_length + (x ^ (x >> 31)) % (self.block_size - self.min_length + 1)

    def __getitem__(self, index: int) -> dict[str, Any]:
        block = self._index(index)
        length = self.length(block)
        return self._sample(np.frombuffer(self._read(block * self.block_size, length), self.dtype))

    def batch(self, indices: Sequence[int]) -> dict[str, Any]:
        """Equal-length blocks in one array (used when no padding is needed)."""
        n = self.block_size
        rows = b"".join(self._read(self._index(i) * n, n) for i in indices)
        return self._sample(np.frombuffer(rows, self.dtype).reshape(len(indices), n))


class TokenPieces(_TokenReader):
    """Each document cut on its own into blocks (pack=false): (start, length) rows from
    the cache's pieces index."""

    def __init__(self, cache: TokenCache, block_size: int, first: int, count: int):
        super().__init__(cache, block_size, first, count)
        self.index_path = str(cache.path / f"pieces-{block_size}.bin")
        self._pieces: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_pieces": None}

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._pieces is None:
            self._pieces = np.memmap(self.index_path, dtype=np.int64, mode="r").reshape(-1, 2)
        start, length = (int(v) for v in self._pieces[self._index(index)])
        return self._sample(np.frombuffer(self._read(start, length), self.dtype))


class PadCollate:
    """Right-pads a list of samples to the longest: input_ids with `pad_id`, labels with
    the ignore index, and an attention_mask of 1 for real tokens."""

    def __init__(self, pad_id: int = 0, ignore_index: int = IGNORE_INDEX):
        self.pad_id, self.ignore_index = pad_id, ignore_index

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), self.ignore_index, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = sample["input_ids"], sample["labels"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def prepare(
    root: str,
    pattern: str = "**/*.txt",
    tokenizer: Any = None,
    text_field: str = "text",
    cache_dir: str | None = None,
    token_dtype: str = "auto",
    rebuild: bool = False,
    **_samples: Any,
) -> TokenCache:
    """The corpus's token cache, built if missing (`runner prepare`; the launcher calls it on
    every node before any rank starts). The arguments that shape samples are not needed."""
    return open_cache(
        root, pattern, load_tokenizer(tokenizer), text_field, cache_dir, token_dtype, rebuild
    )


def text_files(
    root: str,
    block_size: int = 128,
    pattern: str = "**/*.txt",
    val_fraction: float = 0.1,
    tokenizer: Any = None,
    min_length: int | None = None,
    pack: bool = True,
    text_field: str = "text",
    cache_dir: str | None = None,
    token_dtype: str = "auto",
) -> Datasets:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction}: must be between 0 and 1")
    if block_size < 2:
        raise ValueError(f"data.block_size={block_size}: must be at least 2")
    if min_length is not None and not 2 <= min_length <= block_size:
        raise ValueError(f"data.min_length={min_length}: must be in 2..block_size={block_size}")
    if min_length is not None and not pack:
        raise ValueError(
            f"data.min_length={min_length} with data.pack=false: documents already give "
            "ragged blocks; set one of them"
        )
    cache = prepare(root, pattern, tokenizer, text_field, cache_dir, token_dtype)
    count = cache.tokens // block_size if pack else len(cache.pieces(block_size))
    n_val = max(1, round(count * val_fraction))
    if count - n_val < 1:
        raise ValueError(
            f"data.root={root!r}: {cache.tokens} tokens make {count} block(s) of "
            f"data.block_size={block_size}; need at least 2 (one to train on, one to validate)"
        )
    if pack:
        train: Any = TokenBlocks(cache, block_size, 0, count - n_val, min_length)
        val: Any = TokenBlocks(cache, block_size, count - n_val, n_val, min_length)
    else:
        train = TokenPieces(cache, block_size, 0, count - n_val)
        val = TokenPieces(cache, block_size, count - n_val, n_val)
    ragged = min_length is not None or not pack
    return Datasets(
        train=train,
        val=val,
        collate_fn=PadCollate(ignore_index=IGNORE_INDEX) if ragged else None,
        # fixed_length: every sample a whole block, no padding (a step's tokens follow from
        # its samples: runner.train.step.loss_items)
        info={"vocab_size": cache.vocab_size, "block_size": block_size, "fixed_length": not ragged},
    )


text_files.prepare = prepare  # type: ignore[attr-defined]  (see runner.data.datasets)
