"""The shared-memory all-reduce (runner.engines.shared_memory) between 3 real processes, and
where it applies (runner.hardware.shared_memory_obstacle)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runner.hardware import shared_memory_obstacle
from tests.helpers.ranks import start_ranks

WORLD = 3
SLOT_BYTES = 4096  # small: a tensor of 2500 floats takes three rounds
SIZES = [1, 2, 3, 7, 1024, 2500]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def part(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + n)
    return (torch.randn(n, generator=generator) * 10 ** (rank - 1)).to(dtype)


def rank_order_sum(n: int, dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    """((x0 * s) + (x1 * s)) + (x2 * s): the order every element must be summed in."""
    parts = [part(r, n, dtype) for r in range(WORLD)]
    if scale is not None:
        parts = [p * scale for p in parts]
    total = parts[0] + parts[1]
    for p in parts[2:]:
        total = total + p
    return total


def worker(rank: int, init_file: str, failures: Path) -> None:
    from runner.engines.shared_memory import SharedMemoryAllReduce

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        reducer = SharedMemoryAllReduce.open(slot_bytes=SLOT_BYTES)
        assert reducer is not None
        dist.barrier()  # rank 0 has unlinked it
        assert not os.path.exists(reducer.name), "the region's file outlives the mapping"
        for dtype in DTYPES:
            for n in SIZES:
                for scale in (None, 1 / WORLD):
                    if rank == 1 and n == 1024:
                        time.sleep(0.05)  # the others wait for a late rank
                    mine = part(rank, n, dtype)
                    reducer.all_reduce_(mine, scale)
                    expected = rank_order_sum(n, dtype, scale)
                    assert torch.equal(mine, expected), (dtype, n, scale, (mine - expected))
        # 2-D and in the middle of a larger tensor's storage, as DDP's bucket views are
        grid = torch.zeros(4, 10)
        grid[1:3] = float(rank + 1)
        reducer.all_reduce_(grid[1:3])
        assert torch.equal(grid[1:3], torch.full((2, 10), 6.0)) and grid[0].eq(0).all()
    except BaseException as exc:
        failures.joinpath(f"rank{rank}").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown (torch's gloo sometimes aborts there)


@pytest.mark.skipif(
    shared_memory_obstacle("cpu", 1) is not None, reason=str(shared_memory_obstacle("cpu", 1))
)
@pytest.mark.slow
def test_every_element_is_summed_in_rank_order(tmp_path: Path) -> None:
    start_ranks(worker, (str(tmp_path / "init"), tmp_path), WORLD)
    assert not list(tmp_path.glob("rank*")), [p.read_text() for p in tmp_path.glob("rank*")]


def test_where_shared_memory_applies() -> None:
    assert shared_memory_obstacle("cpu", 1, machine="x86_64") is None
    assert "device=cuda" in shared_memory_obstacle("cuda", 1, machine="x86_64")
    assert "device=cuda:1" in shared_memory_obstacle("cuda:1", 1, machine="x86_64")
    assert "nodes=2" in shared_memory_obstacle("cpu", 2, machine="x86_64")
    assert "aarch64" in shared_memory_obstacle("cpu", 1, machine="aarch64")
    assert shared_memory_obstacle("cpu", 1, machine="AMD64") is None
