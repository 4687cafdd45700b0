"""DataLoaders over the samplers: microbatches of (inputs, labels, weights)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from runner.data.sampler import PLACEHOLDER, GlobalBatchSampler, ShardSampler


class WeightedBatches(Dataset):
    """Serves a whole batch per call; placeholder indices become zero-weight samples."""

    def __init__(self, base: Any):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitems__(
        self, indices: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        real = [0 if i == PLACEHOLDER else i for i in indices]
        weights = torch.tensor([0.0 if i == PLACEHOLDER else 1.0 for i in indices])
        if hasattr(self.base, "batch"):
            inputs, labels = self.base.batch(real)
        else:
            inputs, labels = default_collate([self.base[i] for i in real])
        return inputs, labels, weights


def _passthrough(batch: Any) -> Any:
    return batch


def _loader(dataset: Any, batch_sampler: Any, num_workers: int, pin_memory: bool) -> DataLoader:
    return DataLoader(
        WeightedBatches(dataset),
        batch_sampler=batch_sampler,
        collate_fn=_passthrough,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )


def build_train_loader(
    dataset: Any,
    sampler: GlobalBatchSampler,
    num_workers: int,
    pin_memory: bool = False,
) -> DataLoader:
    return _loader(dataset, sampler, num_workers, pin_memory)


def build_eval_loader(
    dataset: Any,
    batch_size: int,
    world_size: int,
    rank: int,
    num_workers: int,
    pin_memory: bool = False,
) -> DataLoader:
    sampler = ShardSampler(len(dataset), batch_size, world_size, rank)
    return _loader(dataset, sampler, num_workers, pin_memory)
