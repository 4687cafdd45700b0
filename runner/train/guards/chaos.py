"""Fault injection for tests and drills: `chaos.kill_rank` fails at `chaos.at_step`
(sigkill, raise), stops there for good (hang), its loss turns NaN there (nan) or 100
times larger (spike), its
checkpoint writes fail from that step on (disk_full), it dies while writing that step's
checkpoint (sigkill_in_checkpoint), or its forward passes run out of memory from that step
on while the microbatch is larger than `chaos.oom_above` (oom).

Fires on the first attempt only (TORCHELASTIC_RESTART_COUNT == 0), so a run
with max_restarts >= 1 shows the restart path end to end.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

from runner import dist as rdist
from runner.models.blocks import find_blocks
from runner.spec.guard_specs import ChaosSpec
from runner.train.step.batch_parts import batch_size

log = logging.getLogger(__name__)

# actions that fire inside the step, not at its start
DELAYED = ("disk_full", "nan", "oom", "sigkill_in_checkpoint", "spike")


class ChaosError(RuntimeError):
    """The exception `chaos.action=raise` throws."""


def _first_attempt() -> bool:
    return rdist.get_attempt() == 0


def maybe_fail(chaos: ChaosSpec, rank: int, step: int) -> None:
    if chaos.kill_rank != rank or chaos.at_step != step or chaos.action in DELAYED:
        return
    if not _first_attempt():
        return
    what = "hangs" if chaos.action == "hang" else f"fails ({chaos.action})"
    log.warning(f"chaos: rank {rank} {what} at step {step} at t={time.time():.3f}")
    sys.stdout.flush()
    sys.stderr.flush()
    if chaos.action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if chaos.action == "hang":  # as a rank stuck in a dead file system or a lost collective
        while True:
            time.sleep(3600)
    raise ChaosError(f"chaos: rank {rank} raised at step {step}")


def maybe_fill_disk(chaos: ChaosSpec, rank: int, step: int, directory: Path) -> None:
    """disk_full: this rank's checkpoint write fails partway, as on a full disk (a file
    half written, then ENOSPC)."""
    if chaos.action != "disk_full" or chaos.kill_rank != rank or chaos.at_step is None:
        return
    if step < chaos.at_step or not _first_attempt():
        return
    path = directory / f"chaos-rank{rank}.bin"
    path.write_bytes(b"\0" * 4096)
    log.warning(f"chaos: rank {rank}'s disk is full at step {step}")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def maybe_kill_in_checkpoint(chaos: ChaosSpec, rank: int, step: int) -> None:
    """sigkill_in_checkpoint: this rank dies while its checkpoint of this step is being
    written: its files begun (under checkpoint.async still in flight), the checkpoint not
    sealed, so it must never become the resume point."""
    hit = chaos.action == "sigkill_in_checkpoint" and chaos.kill_rank == rank
    if hit and chaos.at_step == step and _first_attempt():
        log.warning(f"chaos: rank {rank} is killed while writing the checkpoint of step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


SPIKE = 100.0  # chaos spike: the loss (and so the gradient) of the step times this


def loss_factor(chaos: ChaosSpec, rank: int, step: int) -> float:
    """nan: this rank's loss becomes NaN at this step; spike: it is multiplied by SPIKE."""
    hit = chaos.action in ("nan", "spike") and chaos.kill_rank == rank and chaos.at_step == step
    if not (hit and _first_attempt()):
        return 1.0
    if chaos.action == "nan":
        log.warning(f"chaos: rank {rank}'s loss becomes NaN at step {step}")
        return float("nan")
    log.warning(f"chaos: rank {rank}'s loss is multiplied by {SPIKE:g} at step {step}")
    return SPIKE


def maybe_run_out_of_memory(chaos: ChaosSpec, rank: int, step: int, samples: int) -> None:
    """oom: called in this rank's training forward pass with the microbatch's samples."""
    if chaos.action != "oom" or chaos.kill_rank != rank or chaos.at_step is None:
        return
    if step < chaos.at_step or samples <= chaos.oom_above or not _first_attempt():
        return
    log.warning(f"chaos: rank {rank} runs out of memory at step {step} ({samples} samples)")
    raise torch.OutOfMemoryError(
        f"chaos: rank {rank} ran out of memory at step {step} with a microbatch of {samples} "
        f"samples (chaos.oom_above={chaos.oom_above})"
    )


class Faults:
    """Fault injection as the training loop sees it: hooks it calls at named points. Each
    does nothing unless `chaos.kill_rank` is this rank (and only on the first attempt).

    - `step_started(step)`: sigkill, raise and hang fire here; nan arms the step's loss;
    - `forward(batch)`: the microbatch a training forward pass is about to run (oom reads
      its size in a hook on the model's first block, where FSDP has gathered it);
    - `loss(loss)`: the loss of every microbatch of an armed step turns NaN (or 100x).

    (disk_full fires in the checkpoint's write: runner.train.checkpoints.checkpointing.)"""

    def __init__(self, chaos: ChaosSpec, rank: int, module: torch.nn.Module):
        self.chaos, self.rank = chaos, rank
        self.step, self.batch = 0, None
        self.factor = 1.0  # this step's loss is multiplied by it (chaos.action=nan, spike)
        if chaos.action == "oom" and chaos.kill_rank == rank:
            where = (find_blocks(module) or [module])[0]
            where.register_forward_pre_hook(torch.compiler.disable(self._out_of_memory))

    def step_started(self, step: int) -> None:
        self.step = step
        maybe_fail(self.chaos, self.rank, step)
        self.factor = loss_factor(self.chaos, self.rank, step)

    def forward(self, batch: object) -> None:
        self.batch = batch

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.factor == 1.0 else loss * self.factor

    def _out_of_memory(self, module: torch.nn.Module, _: object) -> None:
        if module.training and self.batch is not None:
            samples = batch_size(self.batch)
            maybe_run_out_of_memory(self.chaos, self.rank, self.step, samples)
