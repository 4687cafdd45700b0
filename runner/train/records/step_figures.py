"""The figures a log record gives of the steps since the one before: samples/s, tokens/s,
MFU, the share of time spent waiting for data, the global gradient norm and peak memory.

What one rank knows (its clock, its data waits) goes into the record when it is made.
What needs every rank (the tokens of every rank's microbatches, each rank's share of the
gradient norm, each rank's peak memory) rides on the all-reduce that brings the record its
loss (runner.train.records.pending_records), and is filled in by `complete`.

MFU (model FLOPs utilisation) = tokens/s x FLOPs per token / (ranks x peak FLOP/s of one
device), with the FLOPs per token of `flops_per_token`; it needs token data and a peak.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from typing import Any

import torch
from torch import nn

from runner.hardware import mfu_dtype, peak_rss_bytes, peak_tflops
from runner.models.shapes import multiplying_parameters
from runner.spec import RunSpec
from runner.train.records.step_times import StepTimes, time_fields

log = logging.getLogger(__name__)

TOKENS, GRAD_NORM = 0, 1  # a record's sums, in this order (see PendingRecords)


def flops_per_token(module: nn.Module) -> float:
    """Training FLOPs (forward and backward) per token: the model's own count where it has
    one (`flops_per_token()`, as runner's gpt does, with attention), else 6 per parameter
    that multiplies (nn.Embedding tables only look up, so they are left out)."""
    own = getattr(module, "flops_per_token", None)
    if callable(own):
        return float(own())
    return 6.0 * multiplying_parameters(module)


def device_peak_flops(spec: RunSpec, device: str) -> float | None:
    """One device's peak FLOP/s for this run: mfu.peak_tflops, else the GPU table by
    mfu.gpu or the device's own name at the run's precision; None on a CPU without
    mfu.peak_tflops, or for a GPU the table does not know (said once in the log)."""
    if spec.mfu.peak_tflops is not None:
        return spec.mfu.peak_tflops * 1e12
    if torch.device(device).type != "cuda":
        return None
    name = spec.mfu.gpu or torch.cuda.get_device_name(torch.device(device))
    dtype = mfu_dtype(spec.precision.name.value)
    peak = peak_tflops(name, dtype)
    if peak is None:
        log.info("MFU: no peak FLOP/s known for %r at %s; set mfu.peak_tflops", name, dtype)
        return None
    return peak * 1e12


def peak_memory_mb(device: str) -> float:
    """This rank's peak memory so far: CUDA's most allocated, or the process's peak RSS."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(torch.device(device)) / 2**20
    return peak_rss_bytes() / 2**20


PARTS_KEY = "_parts"  # a record's step parts, until its reduction completes it


class TrainingClock:
    """Seconds of training: the wall clock, less the time paused out of it (evaluations,
    checkpoints). Each figure over a span reads it at the span's start and end."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._paused = 0.0

    def pause(self, seconds: float) -> None:
        """`seconds` that were not training (an evaluation, a checkpoint) are left out."""
        self._paused += seconds

    def now(self) -> float:
        return time.perf_counter() - self._start - self._paused


class StepFigures:
    """Counts what happens between two log records on this rank."""

    def __init__(
        self,
        spec: RunSpec,
        device: str,
        samples: int,
        flops: float | None,
        world: int,
        counts_tokens: bool = True,
    ):
        """`flops`: the model's FLOPs per token on token data (None: not token data).
        `counts_tokens`: whether this rank's tokens count (one rank of a tensor group: they
        all read the same batch); MFU divides by every rank, the tensor groups' included."""
        self.token_data = flops is not None
        self.counts_tokens = counts_tokens
        self.peak_memory_mb = partial(peak_memory_mb, device)
        peak = device_peak_flops(spec, device) if self.token_data else None
        # MFU per token/s of the whole run
        self.mfu_per_token_rate = None if flops is None or peak is None else flops / (world * peak)
        self.clock = TrainingClock()  # the step log's one clock (the reduction reads it too)
        self.times = StepTimes(device)  # the step's parts (the trainer laps them)
        self._t0 = self.clock.now()
        self._samples0 = samples
        self._waited = 0.0
        self._tokens = 0  # this rank's, of its real microbatches
        self._steps = 0  # since the last record
        self._first = True  # no step done yet by this process

    def step_done(self, samples: int, logged: bool) -> None:
        """After each step: the first one this process runs (compiling, warming up, the
        allocator's first requests) is left out of the figures, unless it is logged
        itself (log_interval=1)."""
        self._steps += 1
        if self._first and not logged:
            self._t0, self._samples0, self._waited, self._tokens = self.clock.now(), samples, 0, 0
            self._steps = 0
            self.times.take()
        self._first = False

    def waited(self, seconds: float) -> None:
        """Time the loop spent waiting for its next batch."""
        self._waited += seconds

    def add_tokens(self, tokens: int) -> None:
        """A step's tokens on this rank (its real microbatches')."""
        if self.token_data and self.counts_tokens:
            self._tokens += tokens

    def take(self, samples: int) -> tuple[dict[str, Any], float, float]:
        """At a log step: the record's local figures, the training seconds they cover, and
        this rank's tokens over them; the count starts again. The step's parts come in
        `complete` (on a GPU their events are read once the reduction waited anyway)."""
        now = self.clock.now()
        elapsed = max(1e-9, now - self._t0)
        fields = {
            "throughput/samples_per_sec": (samples - self._samples0) / elapsed,
            "time/data_wait_share": min(1.0, self._waited / elapsed),
            PARTS_KEY: (self.times.take(), self._waited, self._steps),
        }
        tokens = float(self._tokens)
        self._t0, self._samples0, self._waited, self._tokens = now, samples, 0.0, 0
        self._steps = 0
        return fields, elapsed, tokens

    def complete(
        self, record: dict[str, Any], elapsed: float, sums: list[float], peak_mb: float
    ) -> None:
        """Fill in what the reduction brought: every rank's tokens, the gradient norm's
        square (each rank's share summed; negative: not measured), the largest peak; and
        the step's parts, readable now."""
        if PARTS_KEY in record:  # a training record (take()'s)
            laps, waited, steps = record.pop(PARTS_KEY)
            record.update(time_fields(self.times.seconds(laps), waited, elapsed, steps))
        if self.token_data:
            tokens_per_s = sums[TOKENS] / elapsed
            record["throughput/tokens_per_sec"] = tokens_per_s
            if self.mfu_per_token_rate is not None:
                record["throughput/mfu"] = tokens_per_s * self.mfu_per_token_rate
        if sums[GRAD_NORM] >= 0 and math.isfinite(sums[GRAD_NORM]):
            record["train/grad_norm"] = math.sqrt(sums[GRAD_NORM])
        record["memory/peak_mb"] = peak_mb
