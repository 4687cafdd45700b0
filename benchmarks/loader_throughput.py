"""Tokens per second of training batches read from a token file, one process:

    python benchmarks/loader_throughput.py runner|nanogpt|nanogpt-x CACHE_DIR

`runner`: the trainer's path (a DataLoader over runner.data.text's TokenBlocks, batches
from GlobalBatchSampler, no workers). `nanogpt`: nanoGPT's `get_batch` as train.py has it
(a new np.memmap per batch, random offsets, x and the shifted y stacked from slices);
`nanogpt-x` builds x only, as runner does (its loss shifts the labels). Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

BATCH, BLOCK, BATCHES, WARMUP = 32, 1024, 2000, 50


def nanogpt(path: Path, with_y: bool):
    def get_batch():
        data = np.memmap(path, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - BLOCK, (BATCH,))
        x = torch.stack([torch.from_numpy((data[i : i + BLOCK]).astype(np.int64)) for i in ix])
        if not with_y:
            return x
        y = torch.stack(
            [torch.from_numpy((data[i + 1 : i + 1 + BLOCK]).astype(np.int64)) for i in ix]
        )
        return x, y

    while True:
        yield get_batch()


def runner_batches(cache_dir: Path):
    from runner.data.loaders import build_train_loader
    from runner.data.sampler import GlobalBatchSampler
    from runner.data.text import TokenBlocks
    from runner.data.token_cache import TokenCache

    cache = TokenCache(cache_dir, json.loads((cache_dir / "meta.json").read_text()))
    blocks = TokenBlocks(cache, BLOCK, 0, cache.tokens // BLOCK)
    sampler = GlobalBatchSampler(len(blocks), BATCH, 1, 0, seed=0)
    loader = build_train_loader(blocks, sampler, num_workers=0)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(implementation: str, cache: str) -> None:
    torch.manual_seed(0)
    cache_dir = Path(cache)
    if implementation == "runner":
        batches = runner_batches(cache_dir)
    else:
        batches = nanogpt(cache_dir / "tokens.bin", with_y=implementation == "nanogpt")
    for _ in range(WARMUP):
        next(batches)
    start = time.perf_counter()
    for _ in range(BATCHES):
        next(batches)
    seconds = time.perf_counter() - start
    print(json.dumps({"tokens_per_s": BATCHES * BATCH * BLOCK / seconds}))


if __name__ == "__main__":
    main(*sys.argv[1:])
