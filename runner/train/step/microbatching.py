"""grad_accum=auto: find the largest microbatch that fits, while training.

Each step starts with this rank's whole share of the global batch cut into `accum`
microbatches (np.array_split positions, as the sampler cuts them for a fixed grad_accum,
so the samples of every microbatch are those of a run that used that grad_accum). When a
pass runs out of device memory on any rank, every rank agrees on it before any gradient
of that microbatch is exchanged, drops the pass, doubles `accum` and trains the step again
from its start, cut finer; under DeepSpeed, whose partitions keep the gradients of the
microbatches already done, it goes on from the one that failed. Nothing is trained twice
or skipped, so the step's gradient is the same sum over the same samples (up to float
rounding).

Agreeing: a rank that ran out of memory, or finished its pass, meets the others in rounds
of one all-reduce of [ran out, per rank..., still busy]. A rank still inside a forward
pass that communicates (FSDP gathers weights block by block) joins a round before each of
those collectives (`before_collective`, a forward pre-hook), so every collective is met by
the same one on every rank. Once no rank is busy, all know the same answer.

The trainer sees a step strategy: `FixedMicrobatches` (grad_accum=N) or `AutoMicrobatching`
(grad_accum=auto), built by `microbatch_steps`. Both cut a step's batch (`start`), run one
microbatch's forward and backward pass (`run`; None when the pass was dropped), cut the
rest of the step finer after a drop (`recut`), cut evaluation batches alike
(`eval_pieces`), and say what a checkpoint and summary.json keep.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from runner.engines.base import Engine
from runner.errors import first_line
from runner.spec.mesh import BatchSplit
from runner.train.step.batch_parts import batch_size
from runner.train.step.device_feed import copy_of
from runner.train.step.loss_pass import LossPass
from runner.train.step.pipelined import pipelined_passes

log = logging.getLogger(__name__)


class OutOfMemoryElsewhere(RuntimeError):
    """Raised inside a forward pass when another rank ran out of memory in its own."""


def is_out_of_memory(exc: BaseException) -> bool:
    """A device allocation failure (CUDA's OutOfMemoryError; the CPU allocator's error)."""
    if isinstance(exc, (torch.OutOfMemoryError, OutOfMemoryElsewhere)):
        return True
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate" in str(exc)


def slice_batch(batch: Any, start: int, stop: int, size: int) -> Any:
    """Samples start..stop of a collated batch of `size` samples: tensors (and per-sample
    lists) along their first dimension, however they are nested."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        return {k: slice_batch(v, start, stop, size) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(slice_batch(v, start, stop, size) for v in batch)
    if isinstance(batch, list):
        if len(batch) == size and not any(isinstance(v, (torch.Tensor, Mapping)) for v in batch):
            return batch[start:stop]
        return [slice_batch(v, start, stop, size) for v in batch]
    return batch


def cut_batch(batch: Any, real: bool, start: int, stop: int, parts: int) -> list[Any]:
    """Samples start..stop of this rank's batch as `parts` microbatches of (batch, real,
    start, stop). A part with no sample is a placeholder (the batch's first sample, counted
    as nothing) so every rank runs as many forward and backward passes."""
    size = batch_size(batch)
    pieces = []
    for chunk in np.array_split(np.arange(start, stop), parts):
        if real and len(chunk):
            a, b = int(chunk[0]), int(chunk[-1]) + 1
            pieces.append((slice_batch(batch, a, b, size), True, a, b))
        else:
            pieces.append((slice_batch(batch, 0, 1, size), False, stop, stop))
    return pieces


Forward = Callable[[], tuple[torch.Tensor, Any, Any]]  # a microbatch's (loss, items, targets)
Backward = Callable[[torch.Tensor], None]


@dataclass
class Pass:
    """One microbatch's forward and backward pass that counts: its loss (this rank's sum,
    detached), the items the loss says it covered, its targets, and whether it held
    samples (a placeholder's loss is zero and counts nothing)."""

    loss: torch.Tensor
    count: Any
    targets: Any
    real: bool


def accumulate(
    strategy: FixedMicrobatches | AutoMicrobatching,
    passes: LossPass,
    microbatches: list[Any],
    step: int,
    weight: Any,
) -> list[Pass]:
    """Every microbatch of this rank's share of `step`: its forward pass (`passes.train`)
    and backward pass (of the loss times `weight`), under the engine's context for
    microbatch i of n. Returns the passes that count.

    Under grad_accum=auto a pass that runs out of memory on any rank is dropped on every
    rank and the rest of the step is cut finer (the strategy's `recut`); an engine that
    cannot keep the gradients of the microbatches already done (not ZeRO's partitions)
    starts the step again from its first. Before this start's first step, the engine's
    warm-up pass (`passes.warm_up(first microbatch)`; DDP's) where it needs one."""
    engine = passes.engine
    if engine.stages.count > 1:  # the stages' schedule runs every microbatch at once
        size = strategy.micro_batch_size
        ran = pipelined_passes(engine.stages, passes, microbatches, weight, size)
        return [Pass(loss, count, targets, real) for loss, count, targets, real in ran]

    def backward(loss: torch.Tensor) -> None:
        engine.backward(loss * weight)

    microbatches = strategy.start(microbatches)
    if engine.needs_warm_up and not strategy.cuts:
        engine.warm_up(lambda: passes.warm_up(microbatches[0]))
    done: list[Pass] = []
    while len(done) < len(microbatches):
        i = len(done)
        batch, real = microbatches[i][:2]
        one_pass = partial(passes.train, batch, real, copy_of(microbatches[i]))
        with engine.microbatch(i, len(microbatches)):
            result = strategy.run(one_pass, backward, engine.backward_communicates)
        if result is None:  # out of memory on some rank: cut finer, and go on
            engine.drop_pass()
            if not engine.keeps_microbatches:
                i, done = 0, []  # from the start
            microbatches = microbatches[:i] + strategy.recut(microbatches, i, step)
            continue
        loss, count, targets = result
        done.append(Pass(loss.detach().float(), count, targets, real))
    return done


def microbatch_steps(
    split: BatchSplit, device: str, engine: Engine, resumed: Mapping[str, Any] | None = None
) -> FixedMicrobatches | AutoMicrobatching:
    """The step strategy of the batch's `split` (its grad_accum). Under auto: the count to
    start at (that of the checkpoint this attempt resumes from, `resumed` its client state),
    and a round of agreement before each collective of a forward pass (FSDP's blocks)."""
    if not split.auto:
        return FixedMicrobatches(split)
    start = (resumed or {}).get("grad_accum", 1)
    auto = AutoMicrobatching(split.per_rank, device, start)
    for module in engine.communicating_modules():
        hook = torch.compiler.disable(auto.before_collective)
        module.register_forward_pre_hook(hook, prepend=True)
    log.info("grad_accum=auto: starting at grad_accum=%d", auto.accum)
    return auto


class FixedMicrobatches:
    """grad_accum=N: the sampler cut each rank's share into N microbatches; each runs once."""

    cuts = False  # the batch comes cut by the sampler

    def __init__(self, split: BatchSplit):
        self.accum, self.micro_batch_size = split.accum, split.micro_batch_size

    def start(self, microbatches: list[Any]) -> list[Any]:
        return microbatches

    def run(self, forward: Forward, backward: Backward, communicates: bool) -> Any:
        loss, count, targets = forward()
        backward(loss)
        return loss, count, targets

    def recut(self, microbatches: list[Any], i: int, step: int) -> list[Any]:
        raise AssertionError("a fixed grad_accum never drops a pass")

    def eval_pieces(self, batch: Any, real: bool) -> Iterator[tuple[Any, bool]]:
        yield batch, real

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def summary(self) -> dict[str, Any]:
        return {"grad_accum": self.accum, "micro_batch_size": self.micro_batch_size}


class AutoMicrobatching:
    """The microbatch count of grad_accum=auto, and how every rank agrees to raise it."""

    cuts = True  # the rank's whole share comes as one microbatch; cut here

    def __init__(self, per_rank_batch: int, device: str, start: int = 1):
        self.per_rank_batch = per_rank_batch
        self.device = device
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        # Where the checkpoint a restart or a resume starts from left off: the one place the
        # count is kept, so a restart trains each step at the count the uninterrupted run
        # trained it with (a cut after the checkpoint is met again at its step).
        self.accum = start
        self.armed = False  # inside a training forward pass: the hooks take part in rounds
        self.events: list[dict[str, Any]] = []
        self.last_ran_out: list[int] = []  # the ranks that ran out in the dropped pass
        self._uncut: tuple[Any, bool] = (None, False)  # the step's batch, as the sampler gave it

    @property
    def micro_batch_size(self) -> int:
        return math.ceil(self.per_rank_batch / self.accum)

    def _round(self, ran_out: bool, busy: bool) -> tuple[list[int], bool]:
        flags = torch.zeros(self.world + 1, device=self.device)
        flags[self.rank] = float(ran_out)
        flags[-1] = float(busy)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()
        return [r for r in range(self.world) if values[r]], bool(values[-1])

    def agree(self, ran_out: bool) -> list[int]:
        """After this rank's forward pass (or its out-of-memory error): the ranks that ran out
        of memory in this microbatch, the same list on every rank."""
        self.armed = False
        while True:
            ranks, busy = self._round(ran_out, busy=False)
            if not busy:
                return ranks

    def before_collective(self, *_: Any) -> None:
        """Forward pre-hook of a module that communicates in its forward pass."""
        if not self.armed:
            return
        ranks, _ = self._round(False, busy=True)
        if ranks:
            raise OutOfMemoryElsewhere(f"rank(s) {ranks} ran out of memory")

    def grow(self, step: int, ranks: list[int]) -> str:
        """Double the microbatch count after an out-of-memory error at `step`; the line to
        log. Raises when a microbatch of one sample did not fit."""
        before = self.micro_batch_size
        if before <= 1:
            raise RuntimeError(
                f"grad_accum=auto: rank(s) {ranks} ran out of device memory at step {step} "
                "with a microbatch of 1 sample; the model does not fit: shard it "
                "(parallelism=fsdp or zero3), use activation_checkpointing, precision=bf16, "
                "or more devices"
            )
        self.accum *= 2
        event = {
            "step": step,
            "ranks": ranks,
            "from_micro_batch_size": before,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum": self.accum,
        }
        self.events.append(event)
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()
        return (
            f"grad_accum=auto: rank(s) {ranks} ran out of memory at step {step} with "
            f"microbatches of {before} samples; retrying with {self.micro_batch_size} "
            f"(grad_accum={self.accum})"
        )

    # ------------------------------------------------------------ the step strategy

    def start(self, microbatches: list[Any]) -> list[Any]:
        """The rank's share of the step (one microbatch from the sampler), cut in `accum`."""
        self._uncut = batch, real = microbatches[0][:2]
        return cut_batch(batch, real, 0, batch_size(batch) if real else 0, self.accum)

    def run(self, forward: Forward, backward: Backward, communicates: bool) -> Any:
        """One microbatch's passes, or None when a pass ran out of memory on any rank. The
        ranks agree after the forward pass where the backward pass exchanges gradients
        (FSDP, ZeRO), else after the backward pass (ddp, synced by hand later)."""
        self.armed, ran_out, result = True, False, None
        try:
            result = forward()
        except Exception as exc:
            ran_out = self._ran_out(exc)
        # Past the except block: the failed pass's tensors went with its traceback.
        if communicates and self._agree(ran_out):
            return None
        if result is not None:
            if communicates:
                backward(result[0])
            else:
                try:
                    backward(result[0])
                except Exception as exc:
                    ran_out = self._ran_out(exc)
        if not communicates and self._agree(ran_out):
            return None
        return result

    def _ran_out(self, exc: Exception) -> bool:
        """Re-raise anything but running out of memory; whether it ran out here (not on
        another rank, whose agreement a collective's hook raised)."""
        if not is_out_of_memory(exc):
            raise exc
        here = not isinstance(exc, OutOfMemoryElsewhere)
        what = "out of memory" if here else "stopped"
        log.info("%s: %s", what, first_line(exc))
        return here

    def _agree(self, ran_out: bool) -> bool:
        self.last_ran_out = self.agree(ran_out)
        return bool(self.last_ran_out)

    def recut(self, microbatches: list[Any], i: int, step: int) -> list[Any]:
        """The step from microbatch i on, cut into twice as many microbatches."""
        log.info(self.grow(step, self.last_ran_out))
        batch, real = self._uncut
        stop = batch_size(batch) if real else 0
        return cut_batch(batch, real, microbatches[i][2], stop, 2 * (len(microbatches) - i))

    def eval_pieces(self, batch: Any, real: bool) -> Iterator[tuple[Any, bool]]:
        """An evaluation batch cut like the training batches: no more memory than a training
        microbatch (every rank alike)."""
        if self.accum == 1:
            yield batch, real
            return
        size = batch_size(batch) if real else 0
        for piece, piece_real, _, _ in cut_batch(batch, real, 0, size, self.accum):
            yield piece, piece_real

    def checkpoint_state(self) -> dict[str, Any]:
        return {"grad_accum": self.accum}

    def summary(self) -> dict[str, Any]:
        """Where the microbatch settled, and each time it was cut."""
        return {
            "grad_accum": self.accum,
            "micro_batch_size": self.micro_batch_size,
            "microbatch_retries": self.events,
        }
