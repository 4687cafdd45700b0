"""Freed host memory handed back to the system after building (runner.train.build.heap)."""

from __future__ import annotations

import sys

import pytest

from runner.train.build.heap import give_back_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_freed_holes_in_the_heap_are_given_back() -> None:
    """Blocks below glibc's mmap threshold, each pinned in place by a small neighbour that
    stays: freeing the blocks leaves holes the heap keeps resident, until trimmed."""
    blocks, pins = [], []
    for _ in range(2000):  # 2000 x 64 KiB: 125 MiB in holes
        blocks.append(bytearray(64 * 1024))
        pins.append(bytearray(600))
    blocks.clear()
    held = _rss_mb()
    assert give_back_freed_memory()
    assert held - _rss_mb() > 80, "the holes stayed resident"
    assert len(pins) == 2000
