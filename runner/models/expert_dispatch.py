"""Expert parallelism for experts modules of Hugging Face's shape (parallelism.ep_plan).

transformers 5 keeps a mixture-of-experts layer's experts in one module (Mixtral's
`MixtralExperts`, Qwen-MoE's, OLMoE's, DeepSeek's and most others): every parameter stacked
by expert on dim 0 (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], biases [E, ...]), and
`forward(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]`, each
token's output the weighted sum of its k experts' outputs; the router stays outside. A
module of a user's model that keeps that contract splits the same way.

Under expert parallelism each such module's parameters are DTensors split by expert over
the group (runner.models.expert_split), and its forward becomes: the token's assignments
sorted by expert, sent to the ranks that hold their experts and back
(runner.models.expert_exchange), computed there by the module's own forward over this
rank's experts (its parameters' local parts, `num_experts` the local count, each assignment
weighted 1), then weighted and summed per token here. The module's class, names and
state_dict keys do not change.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from runner.models.expert_exchange import exchange

SPLIT = "_runner_expert_split"  # set on an experts module once its experts are split
DISPATCHED = "ep_dispatch_experts"  # transformers' style for an experts module


def stacked_experts(module: nn.Module) -> int | None:
    """How many experts `module` stacks (its direct parameters' common dim 0, also its
    `num_experts` where it has one), or None when it is no experts module of Hugging Face's
    shape: parameters that do not agree, or a forward that does not take each token's
    chosen experts and their weights (a router's)."""
    sizes = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() >= 1}
    declared = getattr(module, "num_experts", None)
    if len(sizes) != 1 or (isinstance(declared, int) and declared not in sizes):
        return None
    return sizes.pop() if _takes_routing(type(module).forward) else None


def _takes_routing(forward: Any) -> bool:
    """Whether `forward` takes (self,) hidden states, top-k indices and top-k weights."""
    import inspect

    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    kinds = [p.kind for p in params]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(kind in positional for kind in kinds) >= 4


def dispatch(module: nn.Module, group: Any, per_rank: int) -> None:
    """`module`'s forward, from now on, under expert parallelism over `group` (`per_rank`
    experts each, in group order; its parameters already split)."""
    module.forward = functools.partial(_dispatched, module, type(module).forward, group, per_rank)


def _dispatched(
    module: nn.Module,
    original: Any,
    group: Any,
    per_rank: int,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    experts = per_rank * group.size()
    top_k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // top_k  # the token of each assignment, in expert order
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))

    def compute(arrived: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        index = torch.arange(per_rank, device=arrived.device).repeat_interleave(local_counts)
        unit = arrived.new_ones(arrived.shape[0], 1)
        with _local_experts(module, per_rank):
            return original(module, arrived, index[:, None], unit, *args, **kwargs)

    computed = exchange(hidden[token], counts, group, per_rank, compute)
    weights = top_k_weights.reshape(-1)[order, None].to(computed.dtype)
    out = torch.zeros_like(hidden)
    return out.index_add_(0, token, (computed * weights).to(hidden.dtype))


@contextlib.contextmanager
def _local_experts(module: nn.Module, per_rank: int) -> Iterator[None]:
    """`module` seen as holding only this rank's experts: its parameters' local parts (the
    gradient flows back to the split parameters) and `num_experts` their count."""
    held = dict(module._parameters)
    declared = module.__dict__.get("num_experts")
    try:
        for name, param in held.items():
            if param is not None:
                local = param.to_local() if hasattr(param, "to_local") else param
                module._parameters[name] = local  # type: ignore[assignment]
        if declared is not None:
            module.num_experts = per_rank
        yield
    finally:
        module._parameters.update(held)
        if declared is not None:
            module.num_experts = declared
