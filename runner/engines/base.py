"""The interface between the training loop and a parallelism (ddp, zero1, zero2, ...)."""

from __future__ import annotations

import contextlib
import copy
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner import dist as rdist
from runner.engines.optim import build_optimizer, optimizer_state_bytes
from runner.engines.rank_model import WHOLE_MODEL, Fill, Stages
from runner.engines.schedules import build_scheduler
from runner.rundir.checkpoints import DigestingWriter, note_digest
from runner.spec import RunSpec

__all__ = ["Engine", "Fill", "FinalTensor"]


@dataclass(frozen=True)
class FinalTensor:
    """One tensor of model.pt: its name, shape and dtype, known on every rank before any
    value moves, and how to get its whole value: every rank calls `gather` (a collective
    where the tensor is sharded), in the same order; rank 0 writes what it returns."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    gather: Callable[[], torch.Tensor]


class Engine(ABC):
    """Wraps a model and its optimizer for one parallelism.

    The loop calls, per optimizer step: for each microbatch i of n,
    `with engine.microbatch(i, n): loss = f(engine.model(x)); engine.backward(loss)`,
    then `norm = engine.prepare_step()` and `engine.step()` (or `engine.skip_step()`).
    """

    model: nn.Module
    """What the forward pass calls (the wrapped model)."""
    module: nn.Module
    """The plain model underneath: for evaluation and for exporting weights."""
    torch_optimizer: torch.optim.Optimizer | None = None
    """The torch optimizer that steps (under DeepSpeed, the one inside ZeRO's wrapper); None
    for `runner eval` (eval_only), where nothing steps."""
    scheduler: Any = None
    """The learning-rate schedule, stepped once per optimizer step."""
    scaler: torch.amp.GradScaler | None = None
    """fp16's dynamic loss scaler (None for fp32 and bf16, and under ZeRO, whose own is
    DeepSpeedEngine.loss_scale)."""
    stages: Stages = WHOLE_MODEL
    """The stages the model is cut into, which (more than one) run a step's microbatches
    all at once by their schedule (runner.train.step.microbatching); the whole model where
    the loop runs them one by one."""
    loss_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    """Where a microbatch's forward and backward run (the plan's: runner.engines.rank_model)."""
    needs_warm_up = False
    """Whether the loop runs warm_up() before this start's first step."""
    grads_kept = False
    """Whether the gradients are zeroed in place after a step instead of freed
    (keep_gradients)."""
    _grad_bytes: int | None = None
    _grads_noted = False

    @abstractmethod
    def microbatch(self, index: int, count: int) -> AbstractContextManager[Any]:
        """Context for the forward and backward of microbatch `index` of `count`."""

    def keep_gradients(self) -> None:
        """Give every parameter a gradient now and zero it in place after each step, never
        freeing it: under CUDA graphs (compile.mode=reduce-overhead) a backward pass that
        finds no gradient makes its replay's own output buffer the gradient, and the next
        microbatch's replay overwrites that buffer (torch raises "accessing tensor output of
        CUDAGraphs that has been overwritten", pytorch#169545); adding into a gradient that
        outlives the replay is what the graphs need."""
        self.grads_kept = True
        with torch.no_grad():
            for p in self.module.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)

    def backward_scale(self) -> torch.Tensor | float:
        """What backward() multiplies a loss by: fp16's loss scale (a device tensor), else 1.
        A loss that joins the gradient inside the model (a MoE layer's balance losses:
        runner.models.moe) is scaled alike."""
        scale = getattr(self.scaler, "_scale", None) if self.scaler else None
        return scale if scale is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (already weighted by the microbatch's share of the step)."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def prepare_step(self, norm_wanted: bool = True) -> torch.Tensor | None:
        """Finish this step's gradients (sync, unscale, clip) and return their norm on this
        rank, on device, without a host sync: of the whole gradient where every rank holds
        it, of this rank's shards under FSDP. None where the engine checks the gradients
        itself (DeepSpeed) or a loss scaler does (fp16), and when the norm is not wanted
        and clipping did not compute it anyway (reading every gradient costs about 3% of a
        resnet18 step on the CPU)."""
        return None

    clip_norm: torch.Tensor | None = None
    """The global gradient norm before clipping, where prepare_step clipped this step."""

    @property
    def grad_copies(self) -> int:
        """How many ranks hold each element of the gradients: every rank (ddp), or under
        FSDP each copy's (HSDP: `replicate`; 1 where every rank holds its own shard)."""
        return rdist.get_world_size()

    def grad_norm_share(self) -> torch.Tensor | float:
        """This rank's share of the square of the global gradient norm (before clipping):
        summed over the ranks, it is the square. Called at log steps only, after
        prepare_step and before step. A negative share: not measured."""
        world = rdist.get_world_size()
        if self.clip_norm is not None:  # the global norm: every rank has it
            return self.clip_norm.double().square() / world
        norm = local_grad_norm(list(self.module.parameters()))
        if norm is None:
            return -1.0 / world
        return norm.double().square() / self.grad_copies

    def step(self) -> None:
        """Step the optimizer and the schedule, zero the gradients. Under fp16 the scaler
        steps (or skips, when a gradient overflowed on any rank) and adjusts the scale."""
        if self.scaler:
            self.scaler.step(self.torch_optimizer)
            self.scaler.update()
        else:
            self.torch_optimizer.step()
        self.scheduler.step()
        self.torch_optimizer.zero_grad(set_to_none=not self.grads_kept)

    def skip_step(self) -> None:
        """Drop this step's gradients: the weights, the optimizer state and the schedule stay
        as they were (the loss scaler, which saw the gradients unscaled, adjusts its scale)."""
        if self.scaler:
            self.scaler.update()
        self.torch_optimizer.zero_grad(set_to_none=not self.grads_kept)

    def warm_up(self, one_pass: Callable[[], None]) -> None:
        """Run `one_pass` (a forward and backward pass of the first microbatch) and leave no
        trace of it: the RNG streams, the module's buffers and the gradients are as before.
        Only what the engine learned from it stays (see DDPEngine)."""
        self.needs_warm_up = False
        buffers = [b.detach().clone() for b in self.module.buffers()]
        cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            one_pass()
        with torch.no_grad():
            for buffer, saved in zip(self.module.buffers(), buffers, strict=True):
                buffer.copy_(saved)
        self.torch_optimizer.zero_grad(set_to_none=not self.grads_kept)

    def communicating_modules(self) -> list[nn.Module]:
        """Modules whose forward pass starts with a collective (FSDP's weight gathers)."""
        return []

    backward_communicates = True
    """Whether a backward pass may exchange gradients (grad_accum=auto agrees on running out
    of memory before it then; after it where it does not, so a backward pass is retried too)."""
    keeps_microbatches = False
    """grad_accum=auto: True where the gradients of a step's finished microbatches cannot be
    dropped (DeepSpeed accumulates them in its own partitions), so a step that ran out of
    memory goes on from the microbatch that failed; otherwise it starts again."""

    def drop_pass(self) -> None:
        """After a pass abandoned midway (grad_accum=auto, out of memory): undo what it left
        behind, the same on every rank, and unless `keeps_microbatches`, drop the gradients
        of the step so far."""
        self.torch_optimizer.zero_grad(set_to_none=not self.grads_kept)

    @property
    def nonfinite_skips(self) -> int:
        """Steps the engine skipped by itself for a non-finite gradient norm (DeepSpeed)."""
        return 0

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        assert self.torch_optimizer is not None, "eval_only: no optimizer, no learning rate"
        return self.torch_optimizer.param_groups[0]["lr"]

    def build_optimizer(self, spec: RunSpec, module: nn.Module, total_steps: int) -> None:
        """The optimizer and its schedule over `module`'s parameters (as the engine holds
        them); none for `runner eval` (eval_only), which steps nothing."""
        self.optimizer = self.scheduler = None
        if spec.eval_only:
            return
        self.optimizer = build_optimizer(spec.optimizer, module)
        self.scheduler = build_scheduler(spec.scheduler, self.optimizer, total_steps)
        self.watch_state(self.optimizer)

    def watch_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Subclasses call this with the torch optimizer that steps, once it is built. The
        gradients this rank holds are measured during the first step, at their largest: just
        before the optimizer steps, and wherever an engine calls `note_grad_bytes`."""
        self.torch_optimizer = optimizer
        measuring = optimizer.register_step_pre_hook(lambda *_: self.note_grad_bytes())

        def first_step_done(*_: Any) -> None:
            if not self._grads_noted:
                self._grads_noted = True
                measuring.remove()  # the step path keeps no hook that has nothing to do

        optimizer.register_step_post_hook(first_step_done)

    def note_grad_bytes(self) -> None:
        """Measure the gradients held now (during the first step only); keep the largest."""
        if self._grads_noted:
            return
        self._grad_bytes = max(self._grad_bytes or 0, storage_bytes(self._held_grads()))

    def _held_grads(self) -> list[torch.Tensor]:
        return [t.grad for t in self._held_parameters() if t.grad is not None]

    def _held_parameters(self) -> list[torch.Tensor]:
        """The model's parameters and, when they are other tensors (ZeRO's fp32 master
        partitions), the optimizer's."""
        held = {id(p): p for p in self.module.parameters()}
        groups = self.torch_optimizer.param_groups if self.torch_optimizer is not None else []
        for group in groups:
            held.update({id(p): p for p in group["params"]})
        return list(held.values())

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the parameters, gradients and optimizer state this rank holds, measured
        from the tensors' storage, each storage once: the local shards of sharded parameters
        (FSDP's DTensors, ZeRO-3's partitions), ZeRO's fp32 master copies where they are
        copies, and the gradients at their largest during the first step (DDP's
        communication buckets are not counted)."""
        tensors = []
        for p in self._held_parameters():
            tensors.append(p.data)
            partition = getattr(p, "ds_tensor", None)  # ZeRO-3: p.data is empty unless gathered
            if partition is not None:
                tensors.append(partition)
        state = {
            "params": storage_bytes(tensors),
            "grads": self._grad_bytes or 0,
            "optimizer": optimizer_state_bytes(self.torch_optimizer) if self.torch_optimizer else 0,
        }
        return {**state, "total": sum(state.values())}

    @abstractmethod
    def final_tensors(self) -> list[FinalTensor]:
        """model.pt's tensors, in state_dict order, under the plain model's names: one
        consolidated fp32 `state_dict` whatever the parallelism, gathered one tensor at a
        time (runner.train.checkpoints.weights_file). Every rank calls it."""

    @abstractmethod
    def save_checkpoint(self, directory: Path, client_state: dict[str, Any]) -> None:
        """Write the training state and `client_state` into `directory`. Every rank calls it."""

    can_save_async = False
    """Whether save_checkpoint_async writes in the background (checkpoint.async)."""

    def save_checkpoint_async(self, directory: Path, client_state: dict[str, Any]) -> Future:
        """Copy the training state off the device now, write it in the background: the
        future is done once this rank's files are written (its result raises the write's
        error). Every rank calls it; the state is that of this moment, whatever training
        does next."""
        raise NotImplementedError(f"{type(self).__name__} writes checkpoints synchronously")

    @abstractmethod
    def load_checkpoint(self, directory: Path, reshard: Path | None = None) -> dict[str, Any]:
        """Restore the training state from `directory`; return the client state saved with it.

        `reshard` is given when the checkpoint was written by another world size: an empty
        directory, shared by every rank, for any conversion the engine needs (it is removed
        afterwards)."""


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storage behind `tensors` on this rank (a DTensor's local shard), each
    storage counted once however many views of it there are."""
    storages = {}
    for tensor in tensors:
        for local in _plain_parts(tensor.to_local() if hasattr(tensor, "to_local") else tensor):
            storage = local.untyped_storage()
            storages[(storage.data_ptr(), local.device)] = storage.nbytes()
    return sum(storages.values())


def _plain_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a wrapper subclass holds (torchao's float8 weights), else itself."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return [tensor]
    names, _ = flatten()
    return [part for name in names for part in _plain_parts(getattr(tensor, name))]


def local_grad_norm(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The norm of the gradients this rank holds (FSDP: its shards), on device, no sync."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return torch.nn.utils.get_total_norm(local)


_WRITER: ThreadPoolExecutor | None = None


def background_writer() -> ThreadPoolExecutor:
    """The one thread this process writes checkpoints in, one after the other."""
    global _WRITER
    if _WRITER is None:
        _WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner-checkpoint")
    return _WRITER


class Snapshot:
    """Copies of a training state in CPU memory that training cannot change, made into the
    same buffers each time (fresh memory costs a page fault per 4 KB: about as much as the
    copy). The caller must not take a snapshot while the previous one is still being
    written (the Checkpointer waits for it first)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def take(self, state: Any, path: tuple[Any, ...] = ()) -> Any:
        if isinstance(state, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != state.shape or buffer.dtype != state.dtype:
                buffer = self._buffers[path] = torch.empty_like(state, device="cpu")
            return buffer.copy_(state.detach())
        if isinstance(state, dict):
            return {k: self.take(v, (*path, k)) for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.take(v, (*path, i)) for i, v in enumerate(state))
        return copy.deepcopy(state)


def save_durably(obj: Any, path: Path, digest: bool = True) -> None:
    """torch.save, then fsync: a checkpoint is sealed only once its bytes are on disk (DCP
    syncs its files too), so a crash of the machine cannot leave a sealed checkpoint empty.
    `digest`: the bytes are digested as they are written, for the checkpoint's manifest."""
    with open(path, "wb") as f:
        written = DigestingWriter(f) if digest else None
        torch.save(obj, written or f)
        f.flush()
        os.fsync(f.fileno())
    if written is not None:
        note_digest(path, written.digest())
