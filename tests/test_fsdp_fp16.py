"""fp16 under FSDP2: the loss scaler sees every rank's gradient shards (2 real gloo ranks).

fp16 is CUDA-only for users; the engine's scaler logic is the same on CPU, where torch's
GradScaler and FP16 autocast also run, so it is checked here: a gradient that overflows in
one rank's shard only must make every rank skip the step and halve the scale alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from runner.spec.schema import FSDPSpec, OptimizerSpec, Precision, PrecisionSpec, RunSpec
from tests.helpers.engines import engine_of
from tests.helpers.precision_probe import TanhBlocks
from tests.helpers.ranks import start_ranks

WORLD = 2


def full_weights(engine: Any) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().float().clone() for n, p in engine.module.named_parameters()}


def run_steps(rank: int) -> None:
    torch.manual_seed(0)
    spec = RunSpec(
        parallelism=FSDPSpec(),
        optimizer=OptimizerSpec("torch.optim.SGD", {"lr": 0.1, "momentum": 0.9}),
        precision=PrecisionSpec(name=Precision.FP16, init_scale=1024.0),
    )
    engine = engine_of(spec, TanhBlocks(), 3)
    assert engine.scaler is not None
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))

    def one_step(poison: bool, skip: bool = False) -> None:
        with engine.microbatch(0, 1), torch.autocast("cpu", dtype=torch.float16):
            loss = engine.model(x).float().pow(2).mean()
        engine.backward(loss)
        if poison and rank == 1:  # an overflow in rank 1's shard of one gradient only
            engine.module.blocks[0].weight.grad.to_local().view(-1)[0] = float("inf")
        assert engine.prepare_step() is None  # the scaler owns overflow
        engine.skip_step() if skip else engine.step()

    before = full_weights(engine)
    one_step(poison=True)
    assert engine.scaler.get_scale() == 512.0, f"rank {rank}: the scale did not back off"
    for name, value in full_weights(engine).items():
        assert torch.equal(value, before[name]), f"rank {rank}: {name} changed on a skipped step"
    one_step(poison=False)
    assert engine.scaler.get_scale() == 512.0
    after = full_weights(engine)
    assert any(not torch.equal(after[n], before[n]) for n in before), "a good step changed nothing"
    for value in after.values():
        assert torch.isfinite(value).all()
    one_step(poison=False, skip=True)  # nonfinite=skip dropped it (a NaN loss, say)
    assert all(torch.equal(v, after[n]) for n, v in full_weights(engine).items())
    one_step(poison=False)  # the scaler is ready for the next step after a skipped one
    dist.barrier()


def worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        run_steps(rank)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see tests/test_sync_strategies.py: skip gloo's teardown


@pytest.mark.slow
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    start_ranks(worker, (str(tmp_path / "init"),), WORLD)
