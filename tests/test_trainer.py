"""The trainer in this process (a one-rank gloo group): behaviour a run's numbers hide."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from runner.artifacts import RunDir
from runner.spec import resolve_spec
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
    config = compose_config([*FAST, "device=cpu", "nproc=1", "tensorboard=false"])
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
    trainer.train_step(batch, n_global=len(batch[0][0]))
    assert modes == [True]
