"""Random augmentation in a dataset's `__getitem__` is a function of (seed, epoch, sample):
the same at any world size and any number of DataLoader workers, and a restart or resume
ends bit for bit like the run that never stopped (runner.data.sample_seeds)."""

from __future__ import annotations

import pytest
import torch

from runner.data.loaders import Batches
from runner.data.sampler import GlobalBatchSampler, Microbatch
from tests.helpers.augmenting import noisy_digits
from tests.helpers.cli import FAST
from tests.helpers.weights import same_weights

AUGMENTING = [*FAST, "data=custom", "data._target_=tests.helpers.augmenting.noisy_digits"]
RUN = [*AUGMENTING, "max_epochs=null", "max_steps=12", "log_interval=2", "checkpoint.interval=2"]


def test_a_sample_is_augmented_alike_in_any_batch() -> None:
    train = noisy_digits().train
    sampler = GlobalBatchSampler(len(train), 8, 1, 0, seed=3)
    sampler.set_epoch(2)
    first = next(iter(sampler))
    batches = Batches(train, seed=3)
    together, _ = batches.__getitems__(first)
    alone = [batches.__getitems__(Microbatch([i], 2))[0] for i in first]
    assert all(torch.equal(together[0][k], image[0][0]) for k, image in enumerate(alone))

    later, _ = batches.__getitems__(Microbatch(list(first), 3))  # the same samples, epoch 3
    assert torch.equal(together[1], later[1]) and not torch.equal(together[0], later[0])

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    batches.__getitems__(first)  # the main process's own stream goes on as if untouched
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
def test_workers_and_world_sizes_augment_alike(cli) -> None:
    """2 ranks with 2 augmenting loader workers each train what 1 rank without one does."""
    two = cli(*RUN, "nproc=2", "data.num_workers=2", name="two")
    assert two.returncode == 0, two.output
    one = cli(*RUN, "nproc=1", "grad_accum=2", "data.num_workers=0", name="one")
    assert one.returncode == 0, one.output
    x = torch.load(one.run_dir / "model.pt", weights_only=True)
    y = torch.load(two.run_dir / "model.pt", weights_only=True)
    assert all(torch.allclose(x[k], y[k], rtol=1e-5, atol=1e-6) for k in x)


@pytest.mark.slow
def test_a_restart_with_augmenting_workers_and_dropout_ends_bit_for_bit(cli) -> None:
    """Rank 1 dies at step 5; every rank restarts from step 4 with new worker processes, and
    its model's dropout draws on as the uninterrupted run's did (a new DataLoader iterator
    had drawn its workers' seed from that stream: a restart dropped out other units)."""
    dropping = [*RUN, "nproc=2", "data.num_workers=2"]
    dropping += ["model._target_=tests.helpers.augmenting.dropout_mlp"]
    reference = cli(*dropping, name="reference")
    assert reference.returncode == 0, reference.output
    chaos = ["chaos.kill_rank=1", "chaos.at_step=5", "max_restarts=1"]
    killed = cli(*dropping, *chaos, name="killed")
    assert killed.returncode == 0, killed.output
    assert killed.summary()["resumed_from"] == 4
    assert same_weights(reference.run_dir, killed.run_dir)
