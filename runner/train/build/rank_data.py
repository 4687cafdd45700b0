"""This rank's data: its training batches (a global-batch sampler's loader, or its part of a
stream), its share of the validation set, and the run's length in optimizer steps."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from runner.data.loaders import build_eval_loader, build_train_loader
from runner.data.sampler import GlobalBatchSampler
from runner.data.splits import Datasets
from runner.data.streams import (
    TrainStream,
    eval_stream,
    first_examples,
    is_iterable,
    rank_part,
    splits_itself,
)
from runner.spec import RunSpec
from runner.spec.mesh import BatchSplit


@dataclass
class RankData:
    streaming: bool  # an iterable training set: no length, a stream per rank
    sampler: Any  # GlobalBatchSampler, or the TrainStream itself: epochs and global counts
    train_loader: Any  # microbatches, grad_accum (or the rank's whole share) per step
    val_loader: Any  # a loader, a function giving a fresh pass over a stream, or None
    steps_per_epoch: int
    total_steps: int

    def evaluates_after(self, step: int, interval: int | None) -> bool:
        """Whether `step` ends with an evaluation: every `interval` steps (eval_interval), or
        at each epoch's end."""
        return step % (self.steps_per_epoch if interval is None else interval) == 0

    def epoch(self, step: int) -> float:
        """A record's epoch: passes over a stream, or steps over the steps of an epoch."""
        if self.streaming:
            return self.train_loader.passes
        return round(step / self.steps_per_epoch, 4)


def build_rank_data(spec: RunSpec, data: Datasets, split: BatchSplit, pin: bool) -> RankData:
    """This rank's part of the training and validation data, cut by `split`."""
    rank, world = split.data_rank, split.data_world
    streaming = is_iterable(data.train)
    if streaming:  # no length: the run is max_steps long (the parent checked)
        sampler = loader = _train_stream(spec, data, split, pin)
    else:
        sampler = GlobalBatchSampler(
            len(data.train),
            spec.global_batch_size,
            world,
            rank,
            split.accum,  # grad_accum=auto: the rank's whole share, cut in train_step
            shuffle=True,
            seed=spec.seed,
            drop_last=spec.data.drop_last,
        )
        loader = build_train_loader(
            data.train, sampler, spec.data.num_workers, pin, data.collate_fn
        )
    steps_per_epoch = sampler.steps_per_epoch
    return RankData(
        streaming,
        sampler,
        loader,
        _val_loader(spec, data, split, pin),
        steps_per_epoch,
        _total_steps(spec, steps_per_epoch, sampler),
    )


def with_warmup_steps(spec: RunSpec, steps_per_epoch: int) -> RunSpec:
    """scheduler.warmup_epochs in optimizer steps, now that an epoch's length is known."""
    epochs = spec.scheduler.warmup_epochs
    if epochs is None:
        return spec
    steps = round(epochs * steps_per_epoch)
    scheduler = dataclasses.replace(spec.scheduler, warmup_steps=steps, warmup_epochs=None)
    return dataclasses.replace(spec, scheduler=scheduler)


def _train_stream(spec: RunSpec, data: Datasets, split: BatchSplit, pin: bool) -> TrainStream:
    if spec.max_steps is None:
        raise ValueError(
            f"max_steps=null: data={spec.data.name} is an iterable dataset (no length), "
            "so max_epochs cannot say when to stop; set max_steps"
        )
    if spec.scheduler.warmup_epochs is not None:
        raise ValueError(
            f"scheduler.warmup_epochs={spec.scheduler.warmup_epochs}: data={spec.data.name} "
            "is an iterable dataset, so an epoch has no length; use scheduler.warmup_steps"
        )
    return TrainStream(
        rank_part(data.train, split.data_rank, split.data_world),
        split.micro_batch_size,
        split.accum,
        spec.global_batch_size,
        spec.max_steps,
        spec.data.num_workers,
        pin,
        data.collate_fn,
        seed=spec.seed + split.data_rank,
    )


def _val_loader(spec: RunSpec, data: Datasets, split: BatchSplit, pin: bool) -> Any:
    """Every rank's share of the validation set: a loader over a map-style set, or a function
    giving a fresh pass over this rank's part of an iterable one."""
    if data.val is None:
        return None
    rank, world = split.data_rank, split.data_world
    if is_iterable(data.val):  # its first samples, then this rank's part of them
        return eval_stream(
            rank_part(first_examples(data.val, spec.eval_limit), rank, world),
            split.per_rank,
            spec.data.num_workers,
            pin,
            data.collate_fn,
            limit_batches=_self_split_batches(spec, data.val),
        )
    return build_eval_loader(
        data.val,
        split.per_rank,
        world,
        rank,
        spec.data.num_workers,
        pin,
        data.collate_fn,
        limit=spec.eval_limit,
        seed=spec.seed,
        groups=spec.eval_ranks,
    )


def _self_split_batches(spec: RunSpec, val: Any) -> int | None:
    """Batches per rank that make the evaluation's limit, for a stream that splits itself
    (first_examples leaves it whole)."""
    if spec.eval_limit is None or not splits_itself(val):
        return None
    return math.ceil(spec.eval_limit / spec.global_batch_size)


def _total_steps(spec: RunSpec, steps_per_epoch: int, sampler: Any) -> int:
    limits = [spec.max_steps or math.inf]
    if spec.max_epochs is not None:
        limits.append(spec.max_epochs * steps_per_epoch)
    total = min(limits)
    if total < 1:
        raise ValueError(
            f"no training steps: the training set has {sampler.num_samples} samples, "
            f"fewer than global_batch_size={spec.global_batch_size} with drop_last"
        )
    return int(total)
