"""data=hf_text: a text corpus read through Hugging Face `datasets`, from local files only.

`data.path` is one of the library's builders for local files (json, text, csv, parquet,
arrow) and `data.data_files` the files (a path, a glob, a list, or a mapping with `train`
and `validation`). Documents are tokenized (runner.data.tokenizing), joined by the
tokenizer's separator and cut into blocks of block_size + 1 tokens (inputs and next-token
targets), a Hugging Face `map` batch at a time: the tokens left over at the end of a batch
are dropped, as in the library's own language-modelling recipes.

- `data.streaming=true`: an `IterableDataset` read as it trains: nothing is written, the
  corpus may be any size. Each rank reads its own files (runner.data.streams), and the
  position is the library's own `state_dict`, saved in every checkpoint.
- `data.streaming=false`: the library's Arrow cache (under the runner cache), built once
  before the ranks start; a map-style set, so runner's exact global shuffle applies.

Without a `validation` split, the documents whose text hashes into `val_fraction` validate:
the same documents whatever the world size, the order or the streaming mode.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runner.data.splits import Datasets
from runner.data.token_cache import cache_root
from runner.data.tokenizing import load_tokenizer

LOCAL_BUILDERS = ("json", "text", "csv", "parquet", "arrow")
VALIDATION = ("validation", "val")
IDS = "input_ids"


def held_out(example: Mapping[str, Any], text_field: str, fraction: float) -> bool:
    """Is this document in the validation split? A hash of its text decides."""
    text = example[text_field]
    digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def _kept(example: Mapping[str, Any], text_field: str, fraction: float) -> bool:
    return not held_out(example, text_field, fraction)


class BlockPacker:
    """A batched `map` function: documents in, blocks of block_size + 1 token ids out."""

    def __init__(self, tokenizer: Any, text_field: str, block_size: int):
        self.tokenizer, self.text_field, self.block_size = tokenizer, text_field, block_size

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, list[np.ndarray]]:
        texts = [t for t in batch[self.text_field] if t]
        parts: list[np.ndarray] = []
        for ids in self.tokenizer.encode_many(texts):
            parts += [ids, self.tokenizer.separator]
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        span = self.block_size + 1
        count = (len(tokens) - 1) // self.block_size if len(tokens) > self.block_size else 0
        return {
            IDS: [tokens[i * self.block_size : i * self.block_size + span] for i in range(count)]
        }


def collate_blocks(examples: Sequence[Mapping[str, Any]]) -> tuple[Any, Any]:
    """Blocks of block_size + 1 ids -> (inputs, next-token targets)."""
    import torch

    ids = torch.as_tensor(np.stack([np.asarray(e[IDS]) for e in examples]), dtype=torch.long)
    return ids[:, :-1], ids[:, 1:]


class ArrowBlocks:
    """The blocks of a map-style (Arrow-cached) Hugging Face dataset, as (x, y) samples."""

    draws_nothing = True  # no randomness in __getitem__ (runner.data.loaders)

    def __init__(self, dataset: Any):
        self.dataset = dataset.with_format("numpy")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        x, y = collate_blocks([self.dataset[int(index)]])
        return x[0], y[0]

    def batch(self, indices: Sequence[int]) -> tuple[Any, Any]:
        rows = self.dataset[list(indices)][IDS]
        return collate_blocks([{IDS: row} for row in rows])


def _splits(data_files: Any) -> tuple[Any, Any]:
    """(train files, validation files or None) of `data.data_files`."""
    if isinstance(data_files, Mapping):
        val = next((data_files[k] for k in VALIDATION if k in data_files), None)
        if "train" not in data_files:
            raise ValueError(
                f"data.data_files={dict(data_files)}: a mapping needs a `train` entry "
                "(and optionally `validation`)"
            )
        return data_files["train"], val
    return data_files, None


def _files(value: Any) -> Any:
    if isinstance(value, (str, Path)):
        return str(value)
    return [str(v) for v in value]


def _load(path: str, files: Any, streaming: bool, cache_dir: str | None, rebuild: bool) -> Any:
    from datasets import load_dataset

    if path not in LOCAL_BUILDERS:
        raise ValueError(
            f"data.path={path!r}: runner reads local files only; valid: {', '.join(LOCAL_BUILDERS)}"
        )
    hf_cache = str(cache_root(cache_dir) / "hf-datasets")
    mode = "force_redownload" if rebuild and not streaming else None  # "download": local files
    return load_dataset(
        path,
        data_files=_files(files),
        split="train",
        streaming=streaming,
        cache_dir=hf_cache,
        download_mode=mode,
    )


def _blocks(dataset: Any, packer: BlockPacker, streaming: bool, rebuild: bool) -> Any:
    columns = list(dataset.column_names or [])
    if streaming:
        return dataset.map(packer, batched=True, remove_columns=columns or None)
    return dataset.map(
        packer,
        batched=True,
        remove_columns=columns,
        desc="tokenizing",
        load_from_cache_file=not rebuild,
    )


def _check_field(dataset: Any, text_field: str, files: Any) -> None:
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(
            f"data.text_field={text_field!r}: {files} has no such field; it has {columns}"
        )


def hf_text(
    data_files: Any,
    path: str = "json",
    text_field: str = "text",
    streaming: bool = True,
    tokenizer: Any = None,
    block_size: int = 128,
    val_fraction: float = 0.05,
    shuffle_buffer: int = 0,
    seed: int = 0,
    cache_dir: str | None = None,
) -> Datasets:
    return _build(
        data_files, path, text_field, streaming, tokenizer, block_size, val_fraction,
        shuffle_buffer, seed, cache_dir,
    )  # fmt: skip


def _build(
    data_files: Any,
    path: str,
    text_field: str,
    streaming: bool,
    tokenizer: Any,
    block_size: int,
    val_fraction: float,
    shuffle_buffer: int,
    seed: int,
    cache_dir: str | None,
    rebuild: bool = False,
) -> Datasets:
    if block_size < 2:
        raise ValueError(f"data.block_size={block_size}: must be at least 2")
    train_files, val_files = _splits(data_files)
    if val_files is None and not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction}: must be between 0 and 1")
    tok = load_tokenizer(tokenizer)
    packer = BlockPacker(tok, text_field, block_size)
    train = _load(path, train_files, streaming, cache_dir, rebuild)
    _check_field(train, text_field, train_files)
    if val_files is not None:
        val = _load(path, val_files, streaming, cache_dir, rebuild)
    else:
        val = train.filter(
            functools.partial(held_out, text_field=text_field, fraction=val_fraction)
        )
        train = train.filter(functools.partial(_kept, text_field=text_field, fraction=val_fraction))
    train, val = (
        _blocks(train, packer, streaming, rebuild),
        _blocks(val, packer, streaming, rebuild),
    )
    if streaming:
        if shuffle_buffer:
            train = train.shuffle(seed=seed, buffer_size=shuffle_buffer)
        train, val = train.with_format("numpy"), val.with_format("numpy")
        collate = collate_blocks
    else:
        if len(train) == 0 or len(val) == 0:
            raise ValueError(
                f"data.data_files={data_files}: too little text for one training and one "
                f"validation block of data.block_size={block_size}"
            )
        train, val, collate = ArrowBlocks(train), ArrowBlocks(val), None
    info = {"vocab_size": tok.vocab_size, "block_size": block_size}
    return Datasets(train=train, val=val, collate_fn=collate, info=info)


def prepare(
    data_files: Any, path: str = "json", streaming: bool = True, rebuild: bool = False, **rest: Any
) -> str:
    """Before the ranks: build the Arrow cache once (streaming=false), so ranks only open it
    (`runner prepare --rebuild`: again). `rest`: hf_text's other arguments."""
    if streaming:
        return f"streaming {path} files {data_files} (tokenized as they are read)"
    bound = inspect.signature(hf_text).bind(data_files, path, streaming=False, **rest)
    bound.apply_defaults()
    data = _build(*bound.arguments.values(), rebuild=rebuild)
    cached = {f["filename"] for f in data.train.dataset.cache_files}
    where = str(Path(next(iter(cached))).parent) if cached else "memory"
    return f"{len(data.train)} training blocks in the datasets cache {where}"


hf_text.prepare = prepare  # type: ignore[attr-defined]  (see runner.data.datasets)
