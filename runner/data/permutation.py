"""An epoch's shuffle of n samples that costs no memory: position i's sample, on demand.

`np.random.permutation(n)` holds n int64s in every rank: 64 MB for the 8M blocks of a 1 GB
corpus, gigabytes for a real one. Here the order is a keyed bijection of [0, n) (a
Feistel network over the smallest power-of-four domain that holds n, walked along its
cycle until it lands in range), so any slice of the order is computed when it is needed,
from (seed, epoch) alone: every rank, at any world size, gets the same order.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_GOLDEN, _MIX1, _MIX2 = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
)


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finalizer of values + key: every output bit depends on every input bit."""
    z = values * _GOLDEN + key
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class Permutation:
    """The order of epoch `epoch` of n samples under `seed`."""

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        rng = np.random.default_rng([seed, epoch])
        self.keys = rng.integers(0, 2**63, size=ROUNDS, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.mask)
        return (left << self.half) | right

    def take(self, start: int, stop: int) -> np.ndarray:
        """The samples at positions start..stop-1 of the order (int64)."""
        stop = min(stop, self.n)
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        with np.errstate(over="ignore"):
            out = self._encrypt(np.arange(start, stop, dtype=np.uint64))
            outside = out >= self.n
            while outside.any():  # cycle walking: terminates, since x itself is in range
                out[outside] = self._encrypt(out[outside])
                outside = out >= self.n
        return out.astype(np.int64)


class EpochOrder:
    """An epoch's order, sliced by position: computed CHUNK positions at a time (512 KB),
    so a step costs a slice of a cached array, and an epoch of any length costs one chunk."""

    CHUNK = 1 << 16

    def __init__(self, n: int, seed: int, epoch: int, shuffle: bool = True):
        self.n = n
        self.permutation = Permutation(n, seed, epoch) if shuffle else None
        self.chunk_start, self.chunk = -1, np.zeros(0, dtype=np.int64)

    def _positions(self, start: int, stop: int) -> np.ndarray:
        if self.permutation is None:
            return np.arange(start, min(stop, self.n), dtype=np.int64)
        first = start - start % self.CHUNK
        if first != self.chunk_start:
            self.chunk_start = first
            self.chunk = self.permutation.take(first, first + self.CHUNK)
        return self.chunk[start - first : stop - first]

    def __getitem__(self, positions: slice) -> np.ndarray:
        start, stop, _ = positions.indices(self.n)
        parts = []
        while start < stop:
            part = self._positions(start, min(stop, start - start % self.CHUNK + self.CHUNK))
            parts.append(part)
            start += len(part)
        return np.concatenate(parts) if len(parts) != 1 else parts[0]
