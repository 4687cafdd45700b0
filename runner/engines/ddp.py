"""DistributedDataParallel, with the three ways to sync gradients across microbatches."""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from runner import dist as rdist
from runner.engines.base import (
    Engine,
    FinalTensor,
    Snapshot,
    background_writer,
    local_grad_norm,
    save_durably,
)
from runner.engines.dcp_state import STATE_FILE, is_dcp_checkpoint, load_dcp
from runner.engines.precision import grad_scaler
from runner.engines.rank_model import RankModel
from runner.engines.shared_memory import SharedMemoryAllReduce, scaled_sum_hook
from runner.hardware import shared_memory_obstacle
from runner.spec import RunSpec, SyncStrategy

log = logging.getLogger(__name__)


def bucket_view(option: bool | None, strategy: SyncStrategy) -> bool:
    """gradient_as_bucket_view: null turns it on (the gradients alias DDP's buckets, which
    saves copying every gradient into its bucket and back each step, and that memory) where
    it changes no number. Every step starts with no gradient (zero_grad(set_to_none=True)),
    so DDP copies the accumulated gradient into its bucket and scales it there alike either
    way; under multi_auto_sync later microbatches add into the bucket itself and DDP divides
    it in place, which rounds differently when 1/world is inexact (3 ranks)."""
    if option is not None:
        return option
    return strategy is not SyncStrategy.MULTI_AUTO_SYNC


class DDPEngine(Engine):
    def __init__(self, spec: RunSpec, rank_model: RankModel):
        options, module, device = spec.parallelism, rank_model.module, rank_model.device
        self.module = module
        self.strategy = spec.sync_strategy.name
        self.digest = spec.checkpoint.digest  # checkpoint files digested as they are written
        self.model = DistributedDataParallel(
            module,
            device_ids=[torch.device(device).index] if device.startswith("cuda") else None,
            find_unused_parameters=options.find_unused_parameters,
            bucket_cap_mb=options.bucket_cap_mb,
            gradient_as_bucket_view=bucket_view(options.gradient_as_bucket_view, self.strategy),
            static_graph=options.static_graph,
        )
        self.reducer = open_reducer(options.shm_allreduce, device)
        if self.reducer is not None:
            self.model.register_comm_hook(self.reducer, scaled_sum_hook)
        self.backward_communicates = self.strategy is not SyncStrategy.FORCED_SYNC
        # DDP reduces its first iteration in one bucket in parameter order, then rebuilds its
        # buckets in the order gradients became ready. With 3 or more ranks an element's sum
        # depends on where it sits in its bucket (the ring all-reduce adds the ranks' values
        # in an order that depends on the chunk), so a resumed run's first step would round
        # differently from the uninterrupted run's. A discarded warm-up pass at every start
        # has DDP rebuild before the first real step: every step of every start, fresh or
        # resumed, then reduces in the same layout, and restarts stay bit for bit. The
        # shared-memory all-reduce sums every element in rank order wherever it sits: no
        # warm-up there.
        rebuilds = options.static_graph or not options.find_unused_parameters
        self.needs_warm_up = (
            self.backward_communicates
            and rebuilds
            and rdist.get_world_size() >= 3
            and self.reducer is None
        )
        self._resync = False  # the next microbatch syncs (after a dropped pass)
        self.grad_clip_norm = spec.grad_clip_norm
        self.params = list(module.parameters())  # listed once, not every step
        self.build_optimizer(spec, module, rank_model.total_steps)
        self.scaler = grad_scaler(spec.precision, torch.device(device).type)

    def microbatch(self, index: int, count: int) -> AbstractContextManager[Any]:
        last = index == count - 1
        sync = {
            SyncStrategy.SINGLE_AUTO_SYNC: last or self._resync,
            SyncStrategy.MULTI_AUTO_SYNC: True,
            SyncStrategy.FORCED_SYNC: False,
        }[self.strategy]
        self._resync = False
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def drop_pass(self) -> None:
        # A forward pass that syncs arms DDP's gradient hooks for the next backward; the
        # ranks that finished the dropped one are armed, one that ran out of memory in it is
        # not. The next microbatch syncs on every rank, which arms them all alike: one more
        # all-reduce of gradients that are averaged again at the last microbatch anyway
        # (an average of averages is the average).
        self._resync = True
        super().drop_pass()

    def sync_gradients(self) -> None:
        """Finish this step's gradient sync: the manual all-reduce of forced_sync."""
        if self.strategy is SyncStrategy.FORCED_SYNC:
            average_gradients(self.params, self.reducer)

    def prepare_step(self, norm_wanted: bool = True) -> torch.Tensor | None:
        self.sync_gradients()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip_norm is not None:
            norm = self.clip_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip_norm)
            return None if self.scaler else norm
        return local_grad_norm(self.params) if norm_wanted and not self.scaler else None

    def final_tensors(self) -> list[FinalTensor]:
        return [
            FinalTensor(name, value.shape, value.dtype, value.detach)
            for name, value in self.module.state_dict().items()
        ]

    def save_checkpoint(self, directory: Path, client_state: dict[str, Any]) -> None:
        if rdist.get_global_rank() != 0:
            return  # every rank holds the same state: one copy, independent of world size
        save_durably(self._state(client_state), directory / STATE_FILE, self.digest)

    can_save_async = True
    _snapshot: Snapshot | None = None

    def save_checkpoint_async(self, directory: Path, client_state: dict[str, Any]) -> Future:
        """Rank 0 copies the state to CPU memory now and a thread of its own writes it (no
        collective runs there, so it cannot meet the training's); other ranks write nothing."""
        if rdist.get_global_rank() != 0:
            done: Future = Future()
            done.set_result(None)
            return done
        if self._snapshot is None:
            self._snapshot = Snapshot()
        snapshot = self._snapshot.take(self._state(client_state))
        path = directory / STATE_FILE
        return background_writer().submit(save_durably, snapshot, path, self.digest)

    def _state(self, client_state: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "client": client_state,
        }

    def load_checkpoint(self, directory: Path, reshard: Path | None = None) -> dict[str, Any]:
        """ddp's own state file, or a sharded (FSDP2, tensor-parallel) checkpoint's DCP
        files, every tensor read whole."""
        if is_dcp_checkpoint(directory):
            state = load_dcp(directory, self.module, self.optimizer)
        else:
            device = next(self.module.parameters()).device
            state = torch.load(directory / STATE_FILE, map_location=device, weights_only=False)
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        return state["client"]


def open_reducer(option: bool | None, device: str) -> SharedMemoryAllReduce | None:
    """The shared-memory all-reduce where parallelism.shm_allreduce asks for it (null:
    where it applies), else None: the process group's backend reduces."""
    if option is False:
        return None
    world = rdist.get_world_size()
    if world < 2:
        return None
    reason = shared_memory_obstacle(device, world // rdist.get_local_world_size())
    reducer = SharedMemoryAllReduce.open() if reason is None else None
    if reducer is not None:
        log.info("gradients: all-reduced through shared memory (%d ranks)", world)
    elif option:  # the spec's check saw the same machine: only /dev/shm's room is left
        reason = reason or "too little room in /dev/shm"
        log.info("parallelism.shm_allreduce=true: %s; gloo reduces instead", reason)
    return reducer


def average_gradients(
    params: list[nn.Parameter], reducer: SharedMemoryAllReduce | None = None
) -> None:
    """Average gradients across ranks by hand, in one flat all-reduce.

    A parameter that has no gradient on some rank counts as zero there; one
    that has no gradient on any rank is left alone on all of them, so every
    rank makes the same decision.
    """
    world = rdist.get_world_size()
    if world == 1:
        return
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    device = params[0].device  # nccl reduces device tensors only
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    chosen = [p for p, flag in zip(params, has_grad.tolist(), strict=True) if flag]
    if not chosen:
        return
    for p in chosen:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in chosen])
    if reducer is not None:
        reducer.all_reduce_(flat)
    else:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(world)
    offset = 0
    for p in chosen:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
