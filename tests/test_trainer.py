"""The trainer in this process (a one-rank gloo group): behaviour a run's numbers hide."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runner.rundir.files import RunDir
from runner.spec import resolve_spec, save_spec
from runner.train.guards.nonfinite import NonFiniteError
from runner.train.records.step_figures import StepFigures
from runner.train.trainer import Trainer
from tests.helpers.cli import FAST
from tests.helpers.config import compose_config


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
    trainer = build(tmp_path)
    modes: list[bool] = []
    trainer.engine.module.register_forward_hook(lambda m, i, o: modes.append(m.training))

    trainer.engine.model.train()
    trainer.evaluate()
    assert modes and not any(modes), "evaluation ran in training mode"
    assert all(m.training for m in trainer.engine.model.modules())

    modes.clear()
    batch = [next(iter(trainer.data.train_loader))]
    trainer.train_step(batch, n_global=len(batch[0][0]), step=1)
    assert modes == [True]


def build(tmp_path: Path, *overrides: str) -> Trainer:
    config = compose_config([*FAST, "device=cpu", "nproc=1", "logger=none", *overrides])
    (tmp_path / "logs").mkdir(exist_ok=True)
    spec = resolve_spec(config)
    save_spec(spec, tmp_path)  # the run directory's config.yaml, as the parent writes it
    return Trainer(spec, RunDir(tmp_path), "cpu", None)


def poisoned_step(trainer: Trainer, batch: list, n: int, step: int) -> None:
    """A step whose loss is NaN, as chaos.action=nan makes it (the fault hook's switch)."""
    trainer.faults.factor = float("nan")
    try:
        trainer.train_step(batch, n, step=step)
    finally:
        trainer.faults.factor = 1.0


def test_a_skipped_step_leaves_weights_optimizer_and_schedule_alone(
    tmp_path: Path, one_rank_group: None
) -> None:
    """nonfinite=skip: a NaN loss costs that step and nothing else; one skip more than
    nonfinite_max_skips in a row ends the run."""
    trainer = build(tmp_path, "nonfinite=skip", "nonfinite_max_skips=2", "scheduler=cosine")
    batch = [next(iter(trainer.data.train_loader))]
    n = len(batch[0][0])
    trainer.train_step(batch, n, step=1)  # a real step: the optimizer has state now
    weights = copy.deepcopy(trainer.engine.module.state_dict())
    optimizer = copy.deepcopy(trainer.engine.torch_optimizer.state_dict())
    lr = trainer.engine.lr
    for step in (2, 3):
        poisoned_step(trainer, batch, n, step)
    after = trainer.engine.torch_optimizer.state_dict()
    assert all(torch.equal(v, trainer.engine.module.state_dict()[k]) for k, v in weights.items())
    assert all(
        torch.equal(v, after["state"][i][k])
        for i, s in optimizer["state"].items()
        for k, v in s.items()
    )
    assert trainer.engine.lr == lr and trainer.guard.skipped == 2
    trainer.train_step(batch, n, step=4)  # a good step resets the count
    poisoned_step(trainer, batch, n, 5)
    poisoned_step(trainer, batch, n, 6)
    with pytest.raises(NonFiniteError, match=r"at step 7 on rank\(s\) 0; 3 steps in a row"):
        poisoned_step(trainer, batch, n, 7)


def test_stop_catches_a_gradient_that_overflowed_by_the_loss_of_the_next_step(
    tmp_path: Path, one_rank_group: None
) -> None:
    """stop reads no gradient norm per step (reading every gradient costs about 3% of a
    resnet18 step on the CPU): an overflow in the backward pass alone reaches the weights,
    and the next step's loss is where the run notices it."""
    trainer = build(tmp_path)
    batch = [next(iter(trainer.data.train_loader))]
    first = next(trainer.engine.module.parameters())
    hook = first.register_hook(lambda grad: grad * float("inf"))  # overflows in backward only
    loss_sum = trainer.train_step(batch, len(batch[0][0]), step=1).loss_sum
    assert torch.isfinite(loss_sum)
    _, error = trainer.guard.reduce_with(loss_sum.double())
    assert error is None  # nothing noted yet: the loss was finite
    hook.remove()
    loss_sum = trainer.train_step(batch, len(batch[0][0]), step=2).loss_sum
    sums, error = trainer.guard.reduce_with(loss_sum.double())
    assert isinstance(error, NonFiniteError) and error.step == 2
    assert re.search(r"non-finite loss .* at step 2 on rank\(s\) 0", str(error))
    assert not torch.isfinite(sums[0])


def test_skip_and_clipping_still_read_the_gradient_norm(
    tmp_path: Path, one_rank_group: None
) -> None:
    cases = [(["nonfinite=skip"], True), (["grad_clip_norm=1.0"], True), ([], False)]
    for overrides, wanted in cases:
        trainer = build(tmp_path, *overrides)
        batch = [next(iter(trainer.data.train_loader))]
        for microbatch in batch:
            trainer.engine.backward(trainer.passes.loss(microbatch[0])[0])
        norm = trainer.engine.prepare_step(norm_wanted=trainer.guard.mode == "skip")
        assert (norm is not None) == wanted, overrides
        trainer.engine.skip_step()


NO_SUMS = (0.0, -1.0)  # no tokens, no gradient norm


def figures() -> StepFigures:
    spec = resolve_spec(compose_config([]))
    return StepFigures(spec, "cpu", samples=0, flops=None, world=1)


def test_pending_records_are_reduced_together_when_steps_are_fast(
    tmp_path: Path, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first record is reduced at once; records that come fast wait for each other
    (one all-reduce for many); slow ones are reduced one at a time. Their values are the
    same either way. How fast is the records' own training seconds: the first step's
    warming up, outside them, does not make the next record look slow (58e01cd reduced
    the second record at once too: a host sync nobody asked for)."""
    from runner.train.guards.nonfinite import NonFiniteGuard
    from runner.train.records import pending_records

    monkeypatch.setattr(pending_records, "FLUSH_S", 0.05)
    pending = pending_records.PendingRecords(NonFiniteGuard(1, 0, "cpu"), 1, 0, figures())
    time.sleep(0.1)  # the first step: compiling, warming up (left out of the figures)
    pending.add({"step": 10}, torch.tensor(3.0), 2, 1e-4, NO_SUMS)  # then fast steps
    assert pending.due
    done, error = pending.reduce()
    assert error is None and [(r["step"], r["train/loss"]) for r in done] == [(10, 1.5)]
    assert pending.wanted > 1  # that record took microseconds: the next ones wait
    for step in (20, 30, 40):
        pending.add({"step": step}, torch.tensor(float(step)), torch.tensor(4.0), 1e-4, NO_SUMS)
        assert not pending.due
    done, _ = pending.reduce()  # an evaluation, a checkpoint, the last step: at once
    assert [r["train/loss"] for r in done] == [5.0, 7.5, 10.0]

    pending.add({"step": 50}, torch.tensor(1.0), 1, 0.1, NO_SUMS)  # slower than FLUSH_S
    pending.reduce()
    assert pending.wanted == 1
    pending.add({"step": 60}, torch.tensor(1.0), 1, 1.0, NO_SUMS)
    assert pending.due


def test_a_non_finite_loss_logs_the_records_before_it_and_stops(
    tmp_path: Path, one_rank_group: None
) -> None:
    from runner.train.guards.nonfinite import NonFiniteGuard
    from runner.train.records.pending_records import PendingRecords

    guard = NonFiniteGuard(1, 0, "cpu")
    pending = PendingRecords(guard, 1, 0, figures())
    pending.wanted = 10
    for step in (2, 4):
        loss = torch.tensor(float("nan") if step == 4 else 2.0)
        guard.should_skip(loss, None, step)
        pending.add({"step": step}, loss, 1, 1.0, NO_SUMS)
    done, error = pending.reduce()
    assert [(r["step"], r["train/loss"]) for r in done] == [(2, 2.0)]
    assert isinstance(error, NonFiniteError) and error.step == 4


class MiscountingLoss:
    """A loss counting its own items whose count disagrees with what its calls return: the
    mistake the first step's check names."""

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple:
        loss = torch.nn.functional.cross_entropy(outputs, targets, reduction="sum")
        return loss, torch.tensor(len(targets) + 1)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(targets))


def test_a_loss_whose_items_disagree_with_its_count_is_named(
    tmp_path: Path, one_rank_group: None
) -> None:
    """Checked where the host reads the device anyway: the first log step's reduction, not
    the first step (a GPU would wait there)."""
    trainer = build(
        tmp_path,
        "loss=custom",
        "loss._target_=tests.test_trainer.MiscountingLoss",
        "max_epochs=null",
        "max_steps=6",
        "log_interval=3",
    )
    steps_started: list[int] = []
    trainer.faults.step_started = steps_started.append
    with pytest.raises(ValueError, match=r"returned 65 items for a microbatch of 64 \(its count"):
        trainer.fit(time.time())
    assert steps_started == [1, 2, 3]


def test_batches_are_copied_ahead_on_a_gpu_for_a_training_set_of_known_length() -> None:
    """input_prefetch: CUDA only; never for an iterable training set, whose position a
    checkpoint keeps (drawing ahead would move it past batches not yet trained on)."""
    from runner.train.step.device_feed import wanted

    assert wanted(True, "cuda:0", streaming=False)
    assert not wanted(True, "cuda:0", streaming=True)
    assert not wanted(True, "cpu", streaming=False)
    assert not wanted(False, "cuda", streaming=False)


def test_whole_token_blocks_give_a_steps_items_without_a_collective(one_rank_group: None) -> None:
    """Packed text (every sample a whole block, no padding: data.info's fixed_length): a
    step's tokens follow from its samples, the same on every rank, with no all-reduce of
    counts; ragged samples are counted and summed over the ranks as before."""
    from runner.train.losses import CausalLM
    from runner.train.step.loss_items import GlobalItems

    blocks = torch.randint(0, 50, (4, 9))
    microbatches = [({"input_ids": blocks[:2], "labels": blocks[:2]}, True)]
    microbatches += [({"input_ids": blocks[2:], "labels": blocks[2:]}, True)]
    fixed = GlobalItems(CausalLM(), "cpu", fixed_length=True)
    assert fixed.of(microbatches, n_global=12) == 12 * 8  # 8 next-token targets a block
    counted = GlobalItems(CausalLM(), "cpu").of(microbatches, n_global=12)
    assert float(counted) == 4 * 8  # this rank's blocks, summed over the one rank
    ragged = blocks.clone()
    ragged[0, 5:] = -100
    padded = [({"input_ids": blocks, "labels": ragged}, True)]
    assert float(GlobalItems(CausalLM(), "cpu").of(padded, n_global=4)) == 4 * 8 - 4
