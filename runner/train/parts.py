"""What a rank's Trainer is made of, each part built from the inputs it names: the model
under its engine with its data and loss (`build_rank`), then where this attempt starts and
the state that goes on from a checkpoint (`resume_rank`). The Trainer takes them as
values; no part of it is made as a side effect of another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runner.components import instantiate
from runner.engines import import_library
from runner.engines.base import Engine
from runner.engines.rank_model import RankModel
from runner.hardware import library_rss_bytes, rss_bytes
from runner.heartbeat import Heartbeat
from runner.rundir.files import RunDir
from runner.spec import RunSpec
from runner.spec.mesh import BatchSplit, Layout
from runner.train.build.compiling import CompileClock
from runner.train.build.heap import give_back_freed_memory
from runner.train.build.parallelize import parallelize
from runner.train.build.rank_data import RankData, build_rank_data, with_warmup_steps
from runner.train.build.sharded_init import build_for_rank
from runner.train.callback_calls import Callbacks
from runner.train.checkpoints.checkpointer import Checkpointer, Resumed
from runner.train.endings import Endings, endings_of
from runner.train.evaluation import metrics_for
from runner.train.guards.loss_spikes import LossSpikes
from runner.train.guards.nonfinite import NonFiniteGuard
from runner.train.records.notices import Say
from runner.train.records.step_figures import flops_per_token
from runner.train.step.loss_items import GlobalItems
from runner.train.step.microbatching import AutoMicrobatching, FixedMicrobatches, microbatch_steps
from runner.train.step.routing import Routing


@dataclass
class Built:
    """A rank's model under its engine, its data, its loss and metrics."""

    data: RankData
    engine: Engine
    rank_model: RankModel
    loss_fn: Any
    items: GlobalItems  # the global batch's items, each step
    metrics: dict[str, Any]
    channels_last: bool  # inputs go to the device in channels_last too
    compile_clock: CompileClock | None  # the seconds spent compiling (summary.json)
    flops: float | None  # the model's FLOPs per token (token data only)
    base_rss: int  # resident bytes before any of it was built (libraries imported)
    base_library_rss: int  # of them, the libraries' mapped pages (hardware.library_rss_bytes)
    routing: Routing  # the model's mixture-of-experts layers, if any, seen from the loop


def build_rank(
    spec: RunSpec, run_dir: RunDir, device: str, grid: Layout, split: BatchSplit, say: Say
) -> Built:
    """The data, the model under its engine, the loss and the metrics of this rank (at
    `split.data_rank` of the running group's `grid`). Seeded alike on every rank: identical
    initial weights (or, under meta_init, each rank's shards of them); the data is built
    first, as the seed weights were."""
    import_library(spec.parallelism.name)  # the engine's library is in the base
    base_rss = rss_bytes()  # what the model, its data and its engine add comes on top
    base_library_rss = library_rss_bytes()
    data, module, fill = build_for_rank(spec, device, run_dir.seed_weights)
    give_back_freed_memory()  # what building freed (zero.Init builds each module whole)
    token_data = {"vocab_size", "block_size"} <= data.info.keys()
    flops = flops_per_token(module) if token_data else None  # before sharding: all of it
    loss_fn = instantiate(spec.loss.node, data.info)
    fixed = bool(data.info.get("fixed_length"))  # items per sample: no count to reduce
    items = GlobalItems(loss_fn, device, grid.copies, fixed)
    metrics = metrics_for(spec, data.info, device)
    cuda = torch.device(device).type == "cuda"
    rank_data = build_rank_data(spec, data, split, cuda)
    with_warmup = with_warmup_steps(spec, rank_data.steps_per_epoch)
    splits_classes = getattr(loss_fn, "splits_classes", False)  # loss parallel
    parallel = parallelize(
        module, with_warmup, grid, device, rank_data.total_steps, fill, split.accum,
        splits_classes, say,
    )  # fmt: skip
    give_back_freed_memory()  # and what sharding freed, before the first step
    return Built(
        data=rank_data,
        engine=parallel.engine,
        rank_model=parallel.rank_model,
        loss_fn=loss_fn,
        items=items,
        metrics=metrics,
        channels_last=parallel.channels_last,
        compile_clock=parallel.compile_clock,
        flops=flops,
        base_rss=base_rss,
        base_library_rss=base_library_rss,
        routing=Routing(parallel.engine.module, grid, parallel.engine),
    )


@dataclass
class Restarted:
    """Where this attempt starts, and what goes on from the checkpoint it starts at."""

    checkpointer: Checkpointer  # when and how checkpoints are written, resumed
    start: Resumed  # the step, samples and client state this attempt starts from
    spikes: LossSpikes  # the loss-spike watch, its history
    microbatching: FixedMicrobatches | AutoMicrobatching  # grad_accum: fixed, or auto
    endings: Endings  # how a run may end before its last step (early stopping's count)


def resume_rank(
    spec: RunSpec,
    run_dir: RunDir,
    built: Built,
    *,
    split: BatchSplit,
    device: str,
    heart: Heartbeat,
    guard: NonFiniteGuard,
    callbacks: Callbacks,
    written: dict[str, Any],
    say: Say,
) -> Restarted:
    """Every rank: the newest checkpoint's state (a first start has none), and the parts
    whose state a checkpoint keeps, made from it."""
    stream = built.data.train_loader if built.data.streaming else None
    checkpointer = Checkpointer(
        spec, run_dir, built.engine, heart, guard, stream, written,
        saved=callbacks.checkpoint_saved, say=say,
    )  # fmt: skip
    start = checkpointer.resume()
    spikes = LossSpikes(spec.loss_spike, start.state)
    microbatching = microbatch_steps(split, device, built.engine, start.state)
    endings = endings_of(spec, heart, start.state)
    checkpointer.keeps(microbatching, spikes, endings)
    return Restarted(checkpointer, start, spikes, microbatching, endings)
