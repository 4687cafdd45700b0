"""Optimizers and learning-rate schedules from their specs."""

from __future__ import annotations

import math
from typing import Any

import torch

from runner.spec.schema import AdamWSpec, CosineSpec, OptimizerSpec, SchedulerSpec, SGDSpec

NORM_LAYERS = (
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.GroupNorm,
    torch.nn.LayerNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)


def parameter_groups(spec: OptimizerSpec, module: torch.nn.Module) -> list[dict[str, Any]]:
    """One group, or two when norm layers get their own weight decay (norm_weight_decay)."""
    if spec.norm_weight_decay is None:
        return [{"params": list(module.parameters())}]
    norm_ids = {
        id(p) for m in module.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters()
    }
    norm = [p for p in module.parameters() if id(p) in norm_ids]
    other = [p for p in module.parameters() if id(p) not in norm_ids]
    groups: list[dict[str, Any]] = [{"params": other}]
    if norm:
        groups.append({"params": norm, "weight_decay": spec.norm_weight_decay})
    return groups


def build_optimizer(spec: OptimizerSpec, module: torch.nn.Module) -> torch.optim.Optimizer:
    params = parameter_groups(spec, module)
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
                local = value.to_local() if hasattr(value, "to_local") else value  # a shard
                total += local.numel() * local.element_size()
    return total
