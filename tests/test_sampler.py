"""Global batches are the same samples whatever the split over ranks and microbatches."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from runner.data.permutation import EpochOrder
from runner.data.sampler import PLACEHOLDER, GlobalBatchSampler, ShardSampler


def step_samples(
    num: int, batch: int, world: int, accum: int, epoch: int = 0, drop_last: bool = False
):
    """For each optimizer step: the multiset of sample indices trained, over all ranks."""
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(num, batch, world, rank, accum, seed=7, drop_last=drop_last)
        sampler.set_epoch(epoch)
        micro = list(sampler)
        assert len(micro) == len(sampler)
        per_rank.append([micro[i : i + accum] for i in range(0, len(micro), accum)])
    steps = []
    for parts in zip(*per_rank, strict=True):
        samples = sorted(
            i for rank_micro in parts for mb in rank_micro for i in mb if i != PLACEHOLDER
        )
        steps.append(samples)
    return steps


@pytest.mark.parametrize("num", [100, 96, 3])
def test_every_split_trains_the_same_samples_per_step(num: int) -> None:
    reference = step_samples(num, 12, 1, 1)
    for world, accum in [(1, 4), (2, 2), (4, 1), (2, 3), (3, 2), (4, 3)]:
        assert step_samples(num, 12, world, accum) == reference, (world, accum)


def test_epoch_covers_the_dataset_once_and_reshuffles() -> None:
    first = list(itertools.chain(*step_samples(100, 12, 2, 2, epoch=0)))
    assert sorted(first) == list(range(100))
    assert step_samples(100, 12, 2, 2, epoch=1) != step_samples(100, 12, 2, 2, epoch=0)


def test_drop_last_and_global_counts() -> None:
    sampler = GlobalBatchSampler(100, 12, 2, 0, 2, drop_last=True)
    assert sampler.steps_per_epoch == 8
    kept = GlobalBatchSampler(100, 12, 2, 0, 2)
    assert kept.steps_per_epoch == 9
    assert [kept.global_count(s) for s in (0, 7, 8)] == [12, 12, 4]


def test_empty_microbatches_become_placeholders() -> None:
    # last global batch of 3 samples over 2 ranks x 2 microbatches: one slot is empty
    micro = list(GlobalBatchSampler(3, 12, 2, 1, 2, seed=1))
    assert micro[-2:] == [micro[-2], [PLACEHOLDER]]
    assert all(len(m) >= 1 for m in micro)


def test_resume_skips_to_the_exact_step() -> None:
    full = GlobalBatchSampler(100, 12, 2, 1, 2, seed=3)
    full.set_epoch(4)
    resumed = GlobalBatchSampler(100, 12, 2, 1, 2, seed=3)
    resumed.set_epoch(4, start_step=5)
    assert list(resumed) == list(full)[5 * 2 :]


def test_shards_cover_validation_set_once_in_as_many_batches_per_rank() -> None:
    """Every sample once, no padding samples; a rank one sample short ends with a placeholder
    batch, so a model that gathers weights in forward (fsdp, zero3) never waits for it."""
    samplers = [ShardSampler(10, 3, 3, r) for r in range(3)]
    batches = [list(sampler) for sampler in samplers]
    assert [len(b) for b in batches] == [len(s) for s in samplers] == [2, 2, 2]
    assert batches[1][-1] == batches[2][-1] == [PLACEHOLDER]
    real = [i for b in batches for batch in b for i in batch if i != PLACEHOLDER]
    assert sorted(real) == list(range(10))
    assert [list(ShardSampler(12, 2, 3, r)) for r in range(3)][0] == [[0, 3], [6, 9]]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_batches_read_the_first_samples_at_any_world_size(world: int) -> None:
    """eval_batches=2 of 8 samples: the first 16 samples of the set, split over the ranks."""
    batches = [list(ShardSampler(100, 8 // world or 1, world, r, limit=16)) for r in range(world)]
    real = sorted(i for rank in batches for batch in rank for i in batch if i != PLACEHOLDER)
    assert real == list(range(16))
    assert len({len(rank) for rank in batches}) == 1  # every rank meets every collective


@pytest.mark.parametrize(("groups", "world"), [(2, 1), (2, 4), (4, 3), (3, 3), (1, 2)])
@pytest.mark.parametrize("count", [1, 10, 23, 48])
def test_another_runs_eval_batches_sample_for_sample(groups: int, world: int, count: int) -> None:
    """`runner eval` at another world size scores the run's batches (grouped as its
    `groups` data ranks grouped them), each whole on one rank, each rank as many times."""
    run = [list(ShardSampler(count, 4, groups, g)) for g in range(groups)]
    now = [list(ShardSampler(count, 4, world, r, groups=groups)) for r in range(world)]
    real = [sorted(b) for rank in now for b in rank if b != [PLACEHOLDER]]
    assert sorted(real) == sorted(sorted(b) for rank in run for b in rank if b != [PLACEHOLDER])
    assert len({len(rank) for rank in now}) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 65, 1000, 70_001])
def test_the_order_is_a_permutation_of_its_own(n: int) -> None:
    order = EpochOrder(n, seed=7, epoch=3)
    assert sorted(order[0:n].tolist()) == list(range(n))
    pieces = np.concatenate([order[i : i + 999] for i in range(0, n, 999)])  # across chunks
    assert pieces.tolist() == EpochOrder(n, seed=7, epoch=3)[0:n].tolist()


def test_the_order_follows_seed_and_epoch_alone() -> None:
    n = 10_000
    first = EpochOrder(n, seed=1, epoch=0)[0:n]
    assert np.array_equal(first, EpochOrder(n, seed=1, epoch=0)[0:n])
    assert not np.array_equal(first, EpochOrder(n, seed=1, epoch=1)[0:n])
    assert not np.array_equal(first, EpochOrder(n, seed=2, epoch=0)[0:n])
    assert abs(np.corrcoef(np.arange(n), first)[0, 1]) < 0.05  # shuffled, not near sorted
    assert EpochOrder(n, 1, 0, shuffle=False)[5:9].tolist() == [5, 6, 7, 8]
    # Where sample 0 lands, over many epochs: spread over every tenth of the order.
    landing = [int(np.argmax(EpochOrder(100, 0, e)[0:100] == 0)) for e in range(1000)]
    assert min(np.histogram(landing, bins=10, range=(0, 100))[0]) > 60
