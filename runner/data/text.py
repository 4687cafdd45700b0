"""Text files as language-model data: `data=text`, the files under `data.root`.

The files matching `pattern` are read in name order and joined into one token stream, cut
into blocks of `block_size` tokens; the last `val_fraction` of the blocks is the
validation set. Each sample is `{"input_ids", "labels"}` (the loss shifts the labels).
Tokens are the text's UTF-8 bytes unless `tokenizer` names one (a component with
`encode(text) -> list[int]` and `vocab_size`, as Hugging Face tokenizers have).

`min_length` makes the samples ragged: each block is cut to a fixed pseudo-random length
between min_length and block_size, and batches are padded (labels -100, attention_mask
0): the batches of different lengths a real corpus of documents gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runner.data.types import Datasets

IGNORE_INDEX = -100


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, 256 ids."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class TokenBlocks(torch.utils.data.Dataset):
    """Consecutive blocks of a token stream, each cut to its length when `lengths` is set."""

    def __init__(self, blocks: torch.Tensor, lengths: torch.Tensor | None = None):
        self.blocks = blocks
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[index]
        if self.lengths is not None:
            ids = ids[: int(self.lengths[index])]
        return {"input_ids": ids, "labels": ids}

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Equal-length blocks in one indexing op (used when no padding is needed)."""
        ids = self.blocks[torch.as_tensor(indices, dtype=torch.long)]
        return {"input_ids": ids, "labels": ids}


class PadCollate:
    """Right-pads a list of samples to the longest: input_ids with `pad_id`, labels with
    the ignore index, and an attention_mask of 1 for real tokens."""

    def __init__(self, pad_id: int = 0, ignore_index: int = IGNORE_INDEX):
        self.pad_id, self.ignore_index = pad_id, ignore_index

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), self.ignore_index, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = sample["input_ids"], sample["labels"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def text_files(
    root: str,
    block_size: int = 128,
    pattern: str = "**/*.txt",
    val_fraction: float = 0.1,
    tokenizer: Any = None,
    min_length: int | None = None,
) -> Datasets:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: must be between 0 and 1")
    if min_length is not None and not 2 <= min_length <= block_size:
        raise ValueError(f"min_length={min_length}: must be in 2..block_size={block_size}")
    files = sorted(p for p in Path(root).glob(pattern) if p.is_file())
    if not files:
        raise ValueError(f"root={root!r}: no file matches pattern={pattern!r}")
    tokenizer = tokenizer or ByteTokenizer()
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    count = len(tokens) // block_size
    n_val = max(1, round(count * val_fraction))
    if count - n_val < 1:
        raise ValueError(
            f"root={root!r}: {len(tokens)} tokens make {count} block(s) of block_size="
            f"{block_size}; need at least 2 (one to train on, one to validate)"
        )
    blocks = tokens[: count * block_size].view(count, block_size)
    lengths = None
    if min_length is not None:
        generator = torch.Generator().manual_seed(count)  # fixed for the corpus
        lengths = torch.randint(min_length, block_size + 1, (count,), generator=generator)
    train = TokenBlocks(blocks[:-n_val], None if lengths is None else lengths[:-n_val])
    val = TokenBlocks(blocks[-n_val:], None if lengths is None else lengths[-n_val:])
    return Datasets(
        train=train,
        val=val,
        collate_fn=PadCollate(ignore_index=IGNORE_INDEX) if lengths is not None else None,
        info={"vocab_size": int(tokenizer.vocab_size), "block_size": block_size},
    )
