"""The one expert dispatch: how an experts module routes its tokens, alone or under expert
parallelism (parallelism.expert, parallelism.ep_plan).

The contract is transformers 5's, which keeps a mixture-of-experts layer's experts in one
module (Mixtral's `MixtralExperts`, Qwen-MoE's, OLMoE's, DeepSeek's and most others), and
runner's own `Experts` (runner.models.moe) keeps it too: every parameter stacked by expert on
dim 0 (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], biases [E, ...]; runner's `w1`,
`w2`), and `forward(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]`,
each token's output the weighted sum of its k experts' outputs; the router stays outside. A
module of a user's model that keeps that contract splits the same way.

`by_expert` sorts a pass's assignments by expert and counts them, once: runner's Experts
computes on the sorted tokens and `combine`s them back; under expert parallelism the sorted
tokens go to the ranks that hold their experts and back (runner.models.expert_exchange),
computed there by the module's own forward over that rank's experts (its parameters' local
parts, `num_experts` the local count, each assignment weighted 1), and are combined here the
same way. Each token is copied once per assignment and the outputs are put back in place
(permutations, and a sum over a token's k outputs in a fixed order: no atomic adds, so a GPU
run repeats bit for bit). The module's class, names and state_dict keys do not change.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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


@dataclass(frozen=True)
class ByExpert:
    """A pass's assignments (token i's are i*k ... i*k+k-1) sorted by expert."""

    order: torch.Tensor  # the assignments in expert order (stable: token order within one)
    counts: torch.Tensor  # assignments per expert
    top_k: int

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each token once per assignment, in expert order (its backward sums a token's
        copies in a fixed order)."""
        return hidden.repeat_interleave(self.top_k, dim=0)[self.order]

    def combine(self, computed: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each token's k outputs (`computed`, in expert order) weighted and summed, in the
        outputs' dtype."""
        by_pair = torch.empty_like(computed)
        by_pair[self.order] = computed
        width = computed.shape[-1]
        weights = top_k_weights.unsqueeze(-1).to(computed.dtype)
        return (by_pair.view(-1, self.top_k, width) * weights).sum(1)


def by_expert(top_k_index: torch.Tensor, experts: int) -> ByExpert:
    """Sort and count the assignments `top_k_index` [N, k] over `experts` experts."""
    flat = top_k_index.reshape(-1)
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount, of a fixed shape
    return ByExpert(flat.argsort(stable=True), counts, top_k_index.shape[-1])


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
    from runner.models.expert_exchange import exchange  # torch._dynamo's import: 1 s

    sorted_ = by_expert(top_k_index, per_rank * group.size())

    def compute(arrived: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        index = torch.arange(per_rank, device=arrived.device).repeat_interleave(local_counts)
        unit = arrived.new_ones(arrived.shape[0], 1)
        with _local_experts(module, per_rank):
            return original(module, arrived, index[:, None], unit, *args, **kwargs)

    computed = exchange(sorted_.tokens(hidden), sorted_.counts, group, per_rank, compute)
    return sorted_.combine(computed, top_k_weights)


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
