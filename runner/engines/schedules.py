"""Learning-rate schedules: runner's warmup around any scheduler, and the shipped ones.

`scheduler._target_` names a `torch.optim.lr_scheduler` class or a function returning
one; it gets the optimizer and, where it takes it, `total_steps` (the optimizer steps after
warmup). `Warmup` raises the lr linearly to where that scheduler starts, then steps it:
the scheduler never sees the warmup steps, so its own step count starts at 0 after them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from runner import components
from runner.spec.schema import SchedulerSpec


def constant(optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The optimizer's lr at every step."""
    return LambdaLR(optimizer, _one)


def _one(step: int) -> float:
    return 1.0


def cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, min_lr_ratio: float = 0.0
) -> LRScheduler:
    """Cosine decay from the lr to `min_lr_ratio` x lr over `total_steps`."""
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"scheduler.min_lr_ratio={min_lr_ratio}: must be between 0 and 1")
    return LambdaLR(optimizer, CosineDecay(total_steps, min_lr_ratio))


class CosineDecay:
    """Multiplier of the lr at each step. A callable object, not a lambda, so the
    scheduler's state can be saved."""

    def __init__(self, total_steps: int, min_ratio: float):
        self.total = max(1, total_steps)
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        progress = min(1.0, step / self.total)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Warmup:
    """Linear warmup over `steps` optimizer steps to the lrs where `inner` starts (each
    group's own), then `inner`. Stepped once per optimizer step, like any scheduler."""

    def __init__(self, optimizer: torch.optim.Optimizer, inner: Any, steps: int):
        self.optimizer, self.inner, self.steps = optimizer, inner, steps
        self.taken = 0
        self.start = [group["lr"] for group in optimizer.param_groups]
        self._warm()

    def _warm(self) -> None:
        fraction = min(1.0, (self.taken + 1) / self.steps) if self.steps else 1.0
        for group, lr in zip(self.optimizer.param_groups, self.start, strict=True):
            group["lr"] = lr * fraction

    def step(self) -> None:
        self.taken += 1
        if self.taken <= self.steps:
            self._warm()  # at taken == steps: where the inner scheduler starts
        else:
            self.inner.step()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken, "start": self.start, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.taken, self.start = state["taken"], state["start"]
        self.inner.load_state_dict(state["inner"])


def build_scheduler(
    spec: SchedulerSpec, optimizer: torch.optim.Optimizer, total_steps: int
) -> Warmup:
    """The spec's scheduler on `optimizer`, inside runner's warmup."""
    decay_steps = max(1, total_steps - spec.warmup_steps)
    inner = components.instantiate(spec.node, {"optimizer": optimizer, "total_steps": decay_steps})
    if not all(callable(getattr(inner, m, None)) for m in ("step", "state_dict")):
        raise TypeError(
            f"scheduler._target_={spec.target}: gave a {type(inner).__name__}, not a "
            "learning-rate scheduler (an object with step() and state_dict(), such as "
            "torch.optim.lr_scheduler's)"
        )
    return Warmup(optimizer, inner, spec.warmup_steps)
