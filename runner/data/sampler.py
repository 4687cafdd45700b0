"""Global batches, cut into per-rank microbatches so every split sees the same samples.

Each epoch shuffles the whole training set with (seed, epoch) only, then cuts the
permutation into global batches of `global_batch_size` (runner.data.permutation computes
the order a slice at a time: no rank holds a permutation of the whole set). Rank r takes positions
r, r+W, r+2W, ... of each global batch and splits them into `grad_accum`
microbatches. Whatever the world size W and grad_accum, optimizer step k trains
on exactly the samples of global batch k. Nothing is padded or repeated: the
last global batch of an epoch may be smaller (unless drop_last), and a
microbatch that gets no sample is sent as one placeholder index (-1): the loader
serves a stand-in sample whose loss counts zero, so every rank still runs every
forward/backward its collectives expect.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from runner.data.permutation import EpochOrder

PLACEHOLDER = -1


class Microbatch(list):
    """A microbatch's sample indices and the epoch they are drawn in: DataLoader hands it
    as it is to the dataset (in a worker too), whose samples' random augmentation depends on
    the epoch (runner.data.sample_seeds)."""

    def __init__(self, indices: list[int], epoch: int):
        super().__init__(indices)
        self.epoch = epoch


class GlobalBatchSampler:
    """A batch sampler for DataLoader(batch_sampler=...): yields this rank's microbatches."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        world_size: int,
        rank: int,
        grad_accum: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside world_size={world_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.rank = rank
        self.grad_accum = grad_accum
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch's permutation; skip its first `start_step` global batches (resume)."""
        self.epoch = epoch
        self.start_step = start_step

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return math.ceil(self.num_samples / self.global_batch_size)

    def global_count(self, step_in_epoch: int) -> int:
        """Samples in global batch `step_in_epoch` (all ranks together)."""
        start = step_in_epoch * self.global_batch_size
        return max(0, min(self.global_batch_size, self.num_samples - start))

    def microbatches(self, global_batch: np.ndarray) -> list[Microbatch]:
        """This rank's share of one global batch, as `grad_accum` index lists."""
        mine = global_batch[self.rank :: self.world_size]
        chunks = np.array_split(mine, self.grad_accum)
        return [Microbatch(c.tolist() if len(c) else [PLACEHOLDER], self.epoch) for c in chunks]

    def __iter__(self) -> Iterator[Microbatch]:
        order = EpochOrder(self.num_samples, self.seed, self.epoch, self.shuffle)
        g = self.global_batch_size
        for step in range(self.start_step, self.steps_per_epoch):
            yield from self.microbatches(order[step * g : (step + 1) * g])

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.grad_accum


class ShardSampler:
    """Evaluation batches: the first `limit` samples (all: None), in order, no padding,
    grouped as `groups` ranks group them (rank g: samples g, g+G, ..., in batches of
    `batch_size`) and handed out over this world's ranks in turn.

    `groups` is the world size (rank r takes every W-th sample), unless an evaluation
    scores another run's batches (`runner eval`: the run's data ranks), whose batches are
    then the run's, sample for sample, at any world size: a batch's figures (float8's
    scales, a bf16 sum's rounding) depend on which samples share it. Every rank yields the
    same number of batches: a rank one short ends with a placeholder batch, so a model that
    gathers its weights in forward (fsdp, zero3) meets the same collectives on every rank.
    The placeholder counts nothing.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        world_size: int,
        rank: int,
        limit: int | None = None,
        groups: int | None = None,
    ):
        count = num_samples if limit is None else min(num_samples, limit)  # the first `limit`
        self.count, self.batch_size = count, batch_size
        self.groups, self.world_size, self.rank = groups or world_size, world_size, rank
        # batches round by round, group by group (with groups == world, rank r's are group
        # r's); only the last round can lack some, those of its last groups: the list's tail
        rounds = math.ceil(math.ceil(count / self.groups) / batch_size)
        last = sum(1 for g in range(self.groups) if self._batch(rounds - 1, g)) if rounds else 0
        self.total = (rounds - 1) * self.groups + last if rounds else 0
        self.batches = math.ceil(self.total / world_size)

    def _batch(self, round_: int, group: int) -> range:
        b = self.batch_size
        return range(group, self.count, self.groups)[round_ * b : (round_ + 1) * b]

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self.batches):
            k = self.rank + b * self.world_size
            yield list(self._batch(*divmod(k, self.groups))) if k < self.total else [PLACEHOLDER]

    def __len__(self) -> int:
        return self.batches
