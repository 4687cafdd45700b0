"""DataLoaders over the samplers: each yields (batch, real) per microbatch.

`real` is False for a placeholder microbatch (the sampler's PLACEHOLDER index: a rank with
no sample left in the epoch's last, smaller global batch). It still runs forward and
backward, so every rank meets every collective, but its loss counts zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from runner.data.sample_seeds import EVALUATION, SampleSeeds
from runner.data.sampler import PLACEHOLDER, GlobalBatchSampler, ShardSampler
from runner.data.tensor_tree import pinned


class Batches(Dataset):
    """Serves a whole batch per call, collated; a dataset with `batch(indices)` (an
    in-memory TensorData, token blocks) gathers it in one indexing op. Otherwise each sample
    is served with its own random streams (runner.data.sample_seeds), so its augmentation
    is the same on any rank, in any worker, after any restart."""

    def __init__(
        self, base: Any, collate_fn: Callable[[list[Any]], Any] | None = None, seed: int = 0
    ):
        self.base = base
        self.collate_fn = collate_fn or default_collate
        self.seeds = SampleSeeds(seed)

    def __len__(self) -> int:
        return len(self.base)

    def __getitems__(self, indices: Sequence[int]) -> tuple[Any, bool]:
        real = indices[0] != PLACEHOLDER
        chosen = list(indices) if real else [0]
        if hasattr(self.base, "batch") and self.collate_fn is default_collate:
            return self.base.batch(chosen), real
        if getattr(self.base, "draws_nothing", False):  # declared free of randomness
            return self.collate_fn([self.base[i] for i in chosen]), real
        epoch = getattr(indices, "epoch", EVALUATION)
        samples = []
        with self.seeds.streams():
            for i in chosen:
                self.seeds.seed_sample(epoch, i)
                samples.append(self.base[i])
        return self.collate_fn(samples), real


def _passthrough(batch: Any) -> Any:
    return batch


def pinning(collate_fn: Callable[[Any], Any], pin_memory: bool, num_workers: int) -> Any:
    """(collate_fn, DataLoader's pin_memory): without workers the batch is pinned as it is
    collated, in the same thread DataLoader would pin it in, but each tensor once (text's
    input_ids and labels are one tensor: DataLoader pins it twice); with workers
    DataLoader's own pinning thread does it, off the training thread."""
    if not pin_memory or num_workers > 0:
        return collate_fn, pin_memory
    return (lambda batch: pinned(collate_fn(batch))), False


def _loader(
    dataset: Any,
    collate_fn: Any,
    batch_sampler: Any,
    num_workers: int,
    pin_memory: bool,
    seed: int = 0,
) -> DataLoader:
    collate, pin_memory = pinning(_passthrough, pin_memory, num_workers)
    # Each new iterator draws its workers' base seed; without a generator of its own it
    # draws it from torch's global stream, which a model's dropout reads: a resumed run
    # (one iterator more than the run it continues) would drop out other units.
    return DataLoader(
        Batches(dataset, collate_fn, seed),
        batch_sampler=batch_sampler,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )


def build_train_loader(
    dataset: Any,
    sampler: GlobalBatchSampler,
    num_workers: int,
    pin_memory: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    return _loader(dataset, collate_fn, sampler, num_workers, pin_memory, sampler.seed)


def build_eval_loader(
    dataset: Any,
    batch_size: int,
    world_size: int,
    rank: int,
    num_workers: int,
    pin_memory: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    limit: int | None = None,
    seed: int = 0,
    groups: int | None = None,
) -> DataLoader:
    """Every rank's share of the validation set, or of its first `limit` samples, in the
    batches `groups` ranks would make (ShardSampler)."""
    sampler = ShardSampler(len(dataset), batch_size, world_size, rank, limit, groups)
    return _loader(dataset, collate_fn, sampler, num_workers, pin_memory, seed)
