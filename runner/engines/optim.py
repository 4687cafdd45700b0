"""The optimizer from its component spec, with runner's parameter groups.

Every parameter falls in one group by two choices: its weight decay (the optimizer's own;
0 where `no_weight_decay` excludes it; `norm_weight_decay` for norm layers) and its
learning-rate multiplier (the first `lr_multipliers` pattern its name matches). The
optimizer is built on those groups; a group's lr is then its multiplier times the lr the
optimizer set, so the schedule (built next) scales each group from its own start.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from runner import components
from runner.models.pretrained import unwrapped_name
from runner.spec.schema import OptimizerSpec

NORM_LAYERS = (
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.GroupNorm,
    torch.nn.LayerNorm,
    torch.nn.RMSNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)
KINDS = ("bias", "norm", "embedding")  # what no_weight_decay names besides name patterns


def named_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, str]]:
    """Each parameter once, with its name in the plain model and its kind: norm (a norm
    layer's), embedding (an embedding's), bias, or weight."""
    seen: set[int] = set()
    for module_name, owner in module.named_modules(remove_duplicate=False):
        for name, param in owner.named_parameters(recurse=False):
            if id(param) in seen:
                continue  # tied: the first owner decides
            seen.add(id(param))
            if isinstance(owner, NORM_LAYERS):
                kind = "norm"
            elif isinstance(owner, torch.nn.Embedding):
                kind = "embedding"
            else:
                kind = "bias" if name == "bias" else "weight"
            full = f"{module_name}.{name}" if module_name else name
            yield unwrapped_name(full), param, kind


def matches(name: str, pattern: str) -> bool:
    """A pattern names a parameter, or a module and so every parameter under it."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")


def unmatched_patterns(spec: OptimizerSpec, names: list[str]) -> list[str]:
    """The config keys whose name patterns match no parameter of the model (a typo)."""
    found = []
    for pattern in spec.no_weight_decay:
        if pattern not in KINDS and not any(matches(n, pattern) for n in names):
            found.append(f"optimizer.no_weight_decay: {pattern!r}")
    for pattern in spec.lr_multipliers or {}:
        if not any(matches(n, pattern) for n in names):
            found.append(f"optimizer.lr_multipliers: {pattern!r}")
    return found


def parameter_groups(spec: OptimizerSpec, module: torch.nn.Module) -> list[dict[str, Any]]:
    """The groups, in order of their first parameter; the plain group (the optimizer's own
    weight decay and lr) first. One group when runner's keys are left at their defaults."""
    groups: dict[tuple[float | None, float], dict[str, Any]] = {(None, 1.0): {"params": []}}
    for name, param, kind in named_parameters(module):
        decay = spec.norm_weight_decay if kind == "norm" else None
        if any(kind == p or (p not in KINDS and matches(name, p)) for p in spec.no_weight_decay):
            decay = 0.0
        multiplier = next(
            (float(m) for p, m in (spec.lr_multipliers or {}).items() if matches(name, p)), 1.0
        )
        group = groups.setdefault((decay, multiplier), {"params": []})
        group["params"].append(param)
        if decay is not None:
            group["weight_decay"] = decay
        if multiplier != 1.0:
            group["lr_multiplier"] = multiplier
    return [g for g in groups.values() if g["params"]]


def build_optimizer(spec: OptimizerSpec, module: torch.nn.Module) -> torch.optim.Optimizer:
    """The spec's optimizer on `module`'s parameter groups, each group's lr multiplied."""
    optimizer = make_optimizer(spec, parameter_groups(spec, module))
    for group in optimizer.param_groups:
        if "lr_multiplier" in group and "lr" in group:
            group["lr"] = group["lr"] * group["lr_multiplier"]
    return optimizer


def fused_default(spec: OptimizerSpec, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """`fused=True` where torch has a fused kernel for the optimizer (AdamW, Adam, SGD: one
    kernel a step for every tensor, not a few for each), every parameter is a floating
    tensor on a GPU, and the config leaves the choice open (no `fused` or `foreach` set): the
    step a hand-written script takes on a GPU (nanoGPT's). Elsewhere torch's own default."""
    if "fused" in spec.args or "foreach" in spec.args:
        return {}
    params = [p for group in groups for p in group["params"]]
    if not params or any(p.device.type != "cuda" or not p.is_floating_point() for p in params):
        return {}
    try:
        target = components.locate(spec.target)
        takes = "fused" in inspect.signature(target).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}
    return {"fused": True} if takes else {}


def make_optimizer(spec: OptimizerSpec, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Call the spec's target with the groups first; TypeError unless it is an optimizer."""
    node = {**spec.node, **fused_default(spec, groups), "_partial_": True}
    build = components.instantiate(node)
    optimizer = build(groups)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer._target_={spec.target}: gave a {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer"
        )
    return optimizer


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
