"""fp16 under ZeRO-2 and ZeRO-3 (real DeepSpeed, 2 gloo ranks): runner's loss scale works as
torch's GradScaler does under ddp.

fp16 is CUDA-only for users; autocast, DeepSpeed's ZeRO optimizer and the loss scale run on
CPU alike, so the engine is driven here step by step as the training loop drives it: an
overflow in one rank's gradients skips the step on every rank, leaves the weights as they
were, halves the scale and still advances the schedule; `growth_interval` good steps double
the scale; a checkpoint keeps the scale; and the same steps under ddp (GradScaler) end on
the same weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runner.engines.base import Engine
from runner.spec.schema import (
    DDPSpec,
    OptimizerSpec,
    Precision,
    PrecisionSpec,
    RunSpec,
    SchedulerSpec,
    SyncStrategy,
    SyncStrategySpec,
    Zero3Spec,
    ZeroSpec,
)
from tests.helpers.cli import MATRIX
from tests.helpers.engines import engine_of
from tests.helpers.precision_probe import TanhBlocks
from tests.helpers.ranks import start_ranks

WORLD = 2
ZERO = {"zero2": ZeroSpec(name="zero2"), "zero3": Zero3Spec(param_persistence_threshold=0)}
# rank 1's loss at this weight overflows fp16 in the backward pass at the starting scale
OVERFLOWING = 1e5


def spec_for(parallelism) -> RunSpec:
    return RunSpec(
        nproc=WORLD,
        global_batch_size=8,
        parallelism=parallelism,
        optimizer=OptimizerSpec("torch.optim.SGD", {"lr": 0.1, "momentum": 0.9}),
        scheduler=SchedulerSpec("torch.optim.lr_scheduler.StepLR", {"step_size": 1, "gamma": 0.9}),
        precision=PrecisionSpec(name=Precision.FP16, init_scale=1024.0, growth_interval=2),
        sync_strategy=SyncStrategySpec(SyncStrategy.SINGLE_AUTO_SYNC),
    )


def build(parallelism) -> Engine:
    torch.manual_seed(0)  # the same starting weights for every engine
    if isinstance(parallelism, DDPSpec):
        return engine_of(spec_for(parallelism), TanhBlocks(), 8)
    import sys

    engine = engine_of(spec_for(parallelism), TanhBlocks(), 8)
    # DeepSpeed's autotuner would have imported MLflow (installed here) on the way: 1.3 s
    assert "mlflow" not in sys.modules and "deepspeed" in sys.modules
    return engine


def weights(engine: Engine) -> dict[str, torch.Tensor]:
    """The full fp32 weights (gathered where ZeRO-3 partitions them)."""
    return {t.name: t.gather().float().clone() for t in engine.final_tensors()}


def scale_of(engine: Engine) -> float:
    return engine.scaler.get_scale() if engine.scaler else engine.loss_scale.scale


def one_step(engine: Engine, rank: int, overflow: bool = False) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with engine.microbatch(0, 1), torch.autocast("cpu", dtype=torch.float16):
        out = engine.model(x)
    loss = out.float().pow(2).mean() * (OVERFLOWING if overflow and rank == 1 else 1.0)
    engine.backward(loss)
    assert engine.prepare_step() is None  # the loss scale owns overflow under fp16
    engine.step()


def steps(engine: Engine, rank: int) -> list[tuple[float, float]]:
    """Overflow, two good steps, overflow, good step: (scale, lr) after each."""
    seen = []
    for overflow in (True, False, False, True, False):
        one_step(engine, rank, overflow)
        seen.append((scale_of(engine), engine.lr))
    return seen


def check_zero(name: str, rank: int, checkpoint: Path) -> dict[str, torch.Tensor]:
    engine = build(ZERO[name])
    assert engine.loss_scale is not None and engine.loss_scale.scale == 1024.0
    before, lr = weights(engine), engine.lr
    one_step(engine, rank, overflow=True)
    assert engine.loss_scale.scale == 512.0, f"rank {rank}: the scale did not back off"
    for key, value in weights(engine).items():
        assert torch.equal(value, before[key]), f"rank {rank}: {key} changed on a skipped step"
    assert engine.lr == pytest.approx(lr * 0.9), "a skipped step advances the schedule"
    one_step(engine, rank)
    assert engine.loss_scale.scale == 512.0
    one_step(engine, rank)
    assert engine.loss_scale.scale == 1024.0, "growth_interval=2 good steps double it"
    assert all(torch.isfinite(v).all() for v in weights(engine).values())
    assert any(not torch.equal(v, before[k]) for k, v in weights(engine).items())
    one_step(engine, rank, overflow=True)
    one_step(engine, rank)
    assert (engine.loss_scale.scale, engine.loss_scale.good_steps) == (512.0, 1)
    engine.save_checkpoint(checkpoint, {"step": 5})
    dist.barrier()
    restored = build(ZERO[name])
    client = restored.load_checkpoint(checkpoint)
    assert client["step"] == 5 and not any("scale" in key for key in client), client
    assert (restored.loss_scale.scale, restored.loss_scale.good_steps) == (512.0, 1)
    return weights(engine)


def worker(rank: int, init_file: str, name: str, checkpoint: str) -> None:
    os.environ.update(  # what DeepSpeed reads of the launch (torch's launcher sets them)
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD)
    )
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        ddp = build(DDPSpec())
        ddp_seen = steps(ddp, rank)
        zero = check_zero(name, rank, Path(checkpoint))
        # the same five steps again, against ddp's trajectory
        again = build(ZERO[name])
        assert steps(again, rank) == ddp_seen, f"rank {rank}: scales and lrs differ from ddp"
        reference = weights(ddp)
        for key, value in weights(again).items():
            error = ((value - reference[key]).norm() / reference[key].norm()).item()
            assert error < 1e-6, f"rank {rank}: {name} and ddp differ in {key} by {error:.2e}"
        assert zero.keys() == reference.keys()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see tests/test_sync_strategies.py: skip gloo's teardown


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2", pytest.param("zero3", marks=MATRIX)])
def test_an_overflow_skips_alike_and_the_scale_moves_as_gradscaler_s(tmp_path: Path, name):
    args = (str(tmp_path / "init"), name, str(tmp_path / "checkpoint"))
    start_ranks(worker, args, WORLD)
