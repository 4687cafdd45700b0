"""The trainer in this process (a one-rank gloo group): behaviour a run's numbers hide."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runner.artifacts import RunDir
from runner.spec import resolve_spec
from runner.train.batches import split
from runner.train.nonfinite import NonFiniteError
from runner.train.trainer import Trainer
from tests.conftest import FAST
from tests.test_compose import compose_config


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_evaluation_runs_in_eval_mode_and_training_resumes_in_train_mode(
    tmp_path: Path, one_rank_group: None
) -> None:
    """train() is set once per fit, not every step, so evaluate() must switch back."""
    config = compose_config([*FAST, "device=cpu", "nproc=1", "logger=none"])
    (tmp_path / "logs").mkdir()
    trainer = Trainer(resolve_spec(config), RunDir(tmp_path), "cpu", None)
    modes: list[bool] = []
    trainer.engine.module.register_forward_hook(lambda m, i, o: modes.append(m.training))

    trainer.engine.model.train()
    trainer.evaluate()
    assert modes and not any(modes), "evaluation ran in training mode"
    assert all(m.training for m in trainer.engine.model.modules())

    modes.clear()
    batch = [next(iter(trainer.train_loader))]
    trainer.train_step(batch, n_global=len(batch[0][0]), step=1)
    assert modes == [True]


def build(tmp_path: Path, *overrides: str) -> Trainer:
    config = compose_config([*FAST, "device=cpu", "nproc=1", "logger=none", *overrides])
    (tmp_path / "logs").mkdir(exist_ok=True)
    return Trainer(resolve_spec(config), RunDir(tmp_path), "cpu", None)


def test_a_skipped_step_leaves_weights_optimizer_and_schedule_alone(
    tmp_path: Path, one_rank_group: None
) -> None:
    """nonfinite=skip: a NaN loss costs that step and nothing else; one skip more than
    nonfinite_max_skips in a row ends the run."""
    trainer = build(tmp_path, "nonfinite=skip", "nonfinite_max_skips=2", "scheduler=cosine")
    batch = [next(iter(trainer.train_loader))]
    n = len(batch[0][0])
    trainer.train_step(batch, n, step=1)  # a real step: the optimizer has state now
    weights = copy.deepcopy(trainer.engine.module.state_dict())
    optimizer = copy.deepcopy(trainer.engine.torch_optimizer.state_dict())
    lr = trainer.engine.lr
    for step in (2, 3):
        trainer.train_step(batch, n, step=step, poison=True)
    after = trainer.engine.torch_optimizer.state_dict()
    assert all(torch.equal(v, trainer.engine.module.state_dict()[k]) for k, v in weights.items())
    assert all(
        torch.equal(v, after["state"][i][k])
        for i, s in optimizer["state"].items()
        for k, v in s.items()
    )
    assert trainer.engine.lr == lr and trainer.guard.skipped == 2
    trainer.train_step(batch, n, step=4)  # a good step resets the count
    trainer.train_step(batch, n, step=5, poison=True)
    trainer.train_step(batch, n, step=6, poison=True)
    with pytest.raises(NonFiniteError, match=r"at step 7 on rank\(s\) 0; 3 steps in a row"):
        trainer.train_step(batch, n, step=7, poison=True)


def test_stop_catches_a_gradient_that_overflowed_by_the_loss_of_the_next_step(
    tmp_path: Path, one_rank_group: None
) -> None:
    """stop reads no gradient norm per step (reading every gradient costs about 3% of a
    resnet18 step on the CPU): an overflow in the backward pass alone reaches the weights,
    and the next step's loss is where the run notices it."""
    trainer = build(tmp_path)
    batch = [next(iter(trainer.train_loader))]
    first = next(trainer.engine.module.parameters())
    hook = first.register_hook(lambda grad: grad * float("inf"))  # overflows in backward only
    loss_sum, _ = trainer.train_step(batch, len(batch[0][0]), step=1)
    assert torch.isfinite(loss_sum)
    trainer.guard.reduce_with(loss_sum)  # nothing noted yet: the loss was finite
    hook.remove()
    loss_sum, _ = trainer.train_step(batch, len(batch[0][0]), step=2)
    with pytest.raises(NonFiniteError, match=r"non-finite loss .* at step 2 on rank\(s\) 0"):
        trainer.guard.reduce_with(loss_sum)


def test_skip_and_clipping_still_read_the_gradient_norm(
    tmp_path: Path, one_rank_group: None
) -> None:
    cases = [(["nonfinite=skip"], True), (["grad_clip_norm=1.0"], True), ([], False)]
    for overrides, wanted in cases:
        trainer = build(tmp_path, *overrides)
        batch = [next(iter(trainer.train_loader))]
        for microbatch in batch:
            trainer.engine.backward(trainer._loss(*split(microbatch[0]), True, False)[0])
        norm = trainer.engine.prepare_step(norm_wanted=trainer.guard.mode == "skip")
        assert (norm is not None) == wanted, overrides
        trainer.engine.skip_step()
