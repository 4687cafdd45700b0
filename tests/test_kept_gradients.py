"""What CUDA graphs (compile.mode=reduce-overhead) need of the gradients, on CPU ranks: under
keep_gradients a backward pass adds into gradients that existed before it, never makes a new
one (which under the graphs would be a replay's output buffer, overwritten by the next
microbatch's replay), and the weights come out as they do with gradients freed each step.
tests/gpu/test_cuda.py trains with the graphs and grad_accum=2 on a GPU."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from runner.spec.schema import DDPSpec, OptimizerSpec, RunSpec, SyncStrategy, SyncStrategySpec
from tests.helpers.engines import engine_of
from tests.helpers.ranks import start_ranks

WORLD, MICRO, STEPS = 2, 3, 3


def train(rank: int, keep: bool) -> tuple[nn.Module, list[str]]:
    """STEPS steps of MICRO microbatches under DDP; the moments a backward pass found no
    gradient or left one of its own making (not the one before, nor a view of DDP's
    buckets, to which DDP points the gradients when it reduces or rebuilds them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    spec = RunSpec(
        parallelism=DDPSpec(),
        sync_strategy=SyncStrategySpec(name=SyncStrategy.SINGLE_AUTO_SYNC),
        optimizer=OptimizerSpec("torch.optim.AdamW", {}),
    )
    engine = engine_of(spec, model, STEPS)
    if keep:
        engine.keep_gradients()
    replaced = []
    generator = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        for micro in range(MICRO):
            before = [p.grad for p in model.parameters()]
            with engine.microbatch(micro, MICRO):
                x = torch.randn(4, 8, generator=generator)
                engine.backward(engine.model(x).square().mean() / MICRO)
            for name, (p, old) in zip(dict(model.named_parameters()), zip(
                model.parameters(), before, strict=True), strict=True):  # fmt: skip
                bucket = p.grad is not None and p.grad._base is not None  # a view: DDP's
                if old is None or p.grad is None or (p.grad is not old and not bucket):
                    replaced.append(f"step {step} microbatch {micro}: {name}")
        engine.prepare_step()
        engine.step()
    del engine
    gc.collect()
    return model, replaced


def worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        freed, _ = train(rank, keep=False)
        kept, replaced = train(rank, keep=True)
        assert not replaced, replaced
        assert all(p.grad is not None and not p.grad.any() for p in kept.parameters())
        for a, b in zip(freed.parameters(), kept.parameters(), strict=True):
            assert torch.equal(a, b)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as in tests/test_sync_strategies.py: no interpreter teardown with gloo


@pytest.mark.slow
def test_kept_gradients_are_added_into_and_train_the_same_weights(tmp_path: Path) -> None:
    start_ranks(worker, (str(tmp_path / "init"),), WORLD)
