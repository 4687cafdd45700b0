"""Freed host memory handed back to the system (runner.train.build.heap): after building,
and as it is freed on a CPU rank of fsdp or ZeRO."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runner.train.build.heap import EXCHANGED_BLOCK, LARGE_BLOCK, large_block
from tests.helpers.cli import HANG, child_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


HOLES = """
from runner.train.build.heap import give_back_freed_memory

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

blocks, pins = [], []
for _ in range(2000):  # 2000 x 64 KiB: 125 MiB in holes
    blocks.append(bytearray(64 * 1024))
    pins.append(bytearray(600))
blocks.clear()
held = rss_mb()
assert give_back_freed_memory()
assert len(pins) == 2000
print(held - rss_mb())
"""


@pytest.mark.slow
def test_freed_holes_in_the_heap_are_given_back() -> None:
    """Blocks below glibc's mmap threshold, each pinned in place by a small neighbour that
    stays: freeing the blocks leaves holes the heap keeps resident, until trimmed. In a
    process of its own: a test process's heap holds whatever earlier tests left in it."""
    argv = [sys.executable, "-c", HOLES]
    run = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=HANG)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) > 80, "the holes stayed resident"


def test_only_a_cpu_rank_of_fsdp_or_zero_left_to_glibc_maps_large_blocks_alone() -> None:
    for parallelism in ("fsdp", "zero1", "zero2", "zero3"):
        assert large_block(parallelism, "cpu", {}) == LARGE_BLOCK
    # tokens exchanged with the ranks of their experts: buffers that change size every pass
    assert large_block("fsdp", "cpu", {}, exchanges_tokens=True) == EXCHANGED_BLOCK
    assert large_block("fsdp", "cuda:0", {}) is None  # its blocks are device memory
    assert large_block("fsdp", "cuda:0", {}, exchanges_tokens=True) is None
    assert large_block("ddp", "cpu", {}) is None  # holds the whole model anyway
    assert large_block("zero2", "cuda:1", {}) is None
    assert large_block("fsdp", "cpu", {"MALLOC_MMAP_THRESHOLD_": "0"}) is None  # yours


FREED_BLOCKS = """
import sys
from runner.train.build.heap import map_large_blocks_alone

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

def given_back_when_freed():
    blocks, pins = [], []
    for _ in range(40):  # 40 x 2 MiB, as a rank's gathered blocks, each pinned by a neighbour
        blocks.append(bytearray(2 << 20))
        pins.append(bytearray(600))
    before = rss_mb()
    blocks.clear()
    return before - rss_mb()

if sys.argv[1] == "alone":
    assert map_large_blocks_alone()  # as a rank does, before it builds anything
large = bytearray(16 << 20)
del large  # a large block freed: glibc raises its threshold above 2 MiB, as on a rank
print(given_back_when_freed())
"""


@pytest.mark.slow
def test_large_blocks_mapped_alone_go_back_to_the_system_when_freed() -> None:
    """In processes of their own (mallopt holds for the rest of a process's life)."""

    def given_back(mode: str) -> float:
        argv = [sys.executable, "-c", FREED_BLOCKS, mode]
        run = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=HANG)
        assert run.returncode == 0, run.stderr
        return float(run.stdout)

    assert given_back("default") < 10, "glibc's heap keeps the freed blocks (its default)"
    assert given_back("alone") > 70, "each freed block goes back to the system"
