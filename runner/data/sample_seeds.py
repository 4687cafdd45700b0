"""Per-sample random streams: a sample's augmentation is a function of (seed, epoch, index).

A dataset that augments in `__getitem__` draws from torch's, numpy's and Python's global
generators. Left alone, those draws depend on which process serves the sample (the rank,
the DataLoader worker, seeded once when the workers start) and on every draw before it,
so a run at another world size, with other workers, or restarted from a checkpoint (new
workers, seeded anew) augments differently and no longer ends bit for bit. Here the three
generators are seeded from (seed, epoch, sample index) before each sample and put back
after the batch: the same sample gets the same draws wherever and whenever it is served,
and the process's own streams (dropout) go on as if nothing had drawn.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

EVALUATION = -1  # the epoch of an evaluation's samples: the same draws at every evaluation
_MASK = (1 << 64) - 1


def sample_key(seed: int, epoch: int, index: int) -> int:
    """A 64-bit key of (seed, epoch, index): splitmix64 over the three, chained."""
    key = 0
    for value in (seed, epoch, index):
        x = (key ^ (value & _MASK)) + 0x9E3779B97F4A7C15 & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        key = x ^ (x >> 31)
    return key


class SampleSeeds:
    def __init__(self, seed: int):
        self.seed = seed

    @contextmanager
    def streams(self) -> Iterator[None]:
        """Inside: seed each sample with `seed_sample`; after: the streams as they were."""
        saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
        try:
            yield
        finally:
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])

    def seed_sample(self, epoch: int, index: int) -> None:
        key = sample_key(self.seed, epoch, index)
        torch.default_generator.manual_seed(key >> 1)  # the CPU's (torch.manual_seed: 80 us)
        np.random.seed(key & 0xFFFFFFFF)
        random.seed(key)
