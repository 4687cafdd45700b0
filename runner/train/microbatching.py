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
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from runner.artifacts import read_json, write_atomic

RECORD_FILE = "microbatching.json"  # in the run directory: what a restart starts from


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


def batch_size(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor."""
    size = _first_dimension(batch)
    if size is None:
        raise ValueError("grad_accum=auto: a batch needs a tensor with the samples first to cut")
    return size


def _first_dimension(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (Mapping, tuple, list)):
        for value in batch.values() if isinstance(batch, Mapping) else batch:
            size = _first_dimension(value)
            if size is not None:
                return size
    return None


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


class AutoMicrobatching:
    """The microbatch count of grad_accum=auto, and how every rank agrees to raise it."""

    def __init__(self, per_rank_batch: int, run_dir: Path, device: str, start: int = 1):
        self.per_rank_batch = per_rank_batch
        self.record_path = run_dir / RECORD_FILE
        recorded = read_json(self.record_path) or {}
        self.device = device
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        # Where a restart or a resume left off; the largest any rank knows (only the first
        # node's run directory holds the record).
        known = torch.tensor(float(max(start, int(recorded.get("grad_accum", 1)))), device=device)
        dist.all_reduce(known, op=dist.ReduceOp.MAX)
        self.accum = int(known.item())
        self.armed = False  # inside a training forward pass: the hooks take part in rounds
        self.events: list[dict[str, Any]] = []

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
        if self.rank == 0:
            write_atomic(self.record_path, json.dumps(event))
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()
        return (
            f"grad_accum=auto: rank(s) {ranks} ran out of memory at step {step} with "
            f"microbatches of {before} samples; retrying with {self.micro_batch_size} "
            f"(grad_accum={self.accum})"
        )
