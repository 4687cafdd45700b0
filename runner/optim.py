"""Optimizers and learning-rate schedules from their specs."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from runner.spec.schema import AdamWSpec, CosineSpec, OptimizerSpec, SchedulerSpec, SGDSpec


def build_optimizer(
    spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    if isinstance(spec, SGDSpec):
        return torch.optim.SGD(
            params,
            lr=spec.lr,
            momentum=spec.momentum,
            nesterov=spec.nesterov,
            weight_decay=spec.weight_decay,
        )
    if isinstance(spec, AdamWSpec):
        return torch.optim.AdamW(
            params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
        )
    raise ValueError(f"optimizer.name={spec.name!r} has no builder")


class LRSchedule:
    """Multiplier of the base lr at each step: linear warmup, then constant or cosine.

    A plain callable object (not a lambda) so the scheduler state can be saved.
    """

    def __init__(self, spec: SchedulerSpec, total_steps: int):
        self.warmup = spec.warmup_steps
        self.cosine = isinstance(spec, CosineSpec)
        self.min_ratio = spec.min_lr_ratio if isinstance(spec, CosineSpec) else 1.0
        self.total = max(1, total_steps)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if not self.cosine:
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    spec: SchedulerSpec, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LRSchedule(spec, total_steps))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the per-parameter state tensors (momentum, exp_avg, ...) this rank holds.

    Scalar step counters are bookkeeping, not state that scales with the model.
    """
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                total += value.numel() * value.element_size()
    return total
