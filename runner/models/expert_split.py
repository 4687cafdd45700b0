"""Expert parallelism (parallelism.expert=E): each mixture-of-experts layer's experts split
across a group of E data ranks, n_experts / E each, in group order; a token goes to the
rank that holds its expert and back by all-to-all (runner.models.expert_exchange).

The split experts are DTensors over the mesh's expert dimension, split by expert (dim 0):
FSDP2 then shards each rank's experts further over the other data ranks, and a checkpoint,
model.pt and the optimizer's state see every expert under its global index, so a run
resumes at another expert degree, or under ddp. The other layers are untouched: FSDP
shards them over every data rank, the expert groups included (they read different data).

What the experts' gradients need: every rank of a group sends its tokens' gradients to the
experts' ranks, so an expert's gradient on its rank sums the group's tokens; FSDP then sums
over the rest of the data ranks and divides by all of them (runner.engines.fsdp).

Which experts split: the experts modules the model's family names (runner's gpt_moe: every
layer's `moe.experts`; a Hugging Face mixture of experts: its config's own
`base_model_ep_plan`), or those a user's `parallelism.ep_plan` names (patterns of module
names, `*` a layer number); each keeps transformers' experts contract and is dispatched by
one mechanism (runner.models.expert_dispatch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from runner.models.expert_dispatch import (
    DISPATCHED,
    SPLIT,
    dispatch,
    stacked_experts,
)
from runner.spec.mesh import divisors

PLAN_KEY = "parallelism.ep_plan"


def split_experts(model: nn.Module) -> list[nn.Module]:
    """The experts modules of `model` that expert parallelism split (after apply_experts)."""
    return [m for m in model.modules() if getattr(m, SPLIT, False)]


EpPlan = Sequence[str] | Mapping[str, Any] | None  # patterns, or {_target_: fn}: fn(model)


def plan_patterns(model: nn.Module, ep_plan: EpPlan) -> list[str]:
    """The module names (patterns) a plan gives: the user's list, what the user's function
    returns for the model, or the experts modules its family names (a Hugging Face MoE's)."""
    if isinstance(ep_plan, Mapping):
        from runner.components import TARGET, locate

        options = {k: v for k, v in ep_plan.items() if not k.startswith("_")}
        return [str(name) for name in locate(str(ep_plan[TARGET]))(model, **options)]
    if ep_plan is not None:
        return list(ep_plan)
    from runner.models.families import family_of

    return family_of(model).expert_patterns(model)


def named_experts(model: nn.Module, ep_plan: EpPlan) -> tuple[dict[str, nn.Module], list[str]]:
    """The experts modules a plan names (the user's, else those the model's family names),
    by name; and the user's patterns that name no module."""
    from runner.models.module_names import expand_patterns

    patterns = plan_patterns(model, ep_plan)
    expanded, unmatched = expand_patterns(model, dict.fromkeys(patterns, DISPATCHED))
    modules = dict(model.named_modules())
    found = {name: modules[name] for name in expanded if name in modules}
    return found, unmatched if ep_plan is not None else []


def expert_problems(
    model: nn.Module, expert: int, ep_plan: EpPlan = None, shard: int | None = None
) -> list[str]:
    """What expert parallelism needs of the model: mixture-of-experts layers (runner's, or
    experts modules its plan names), whose experts the group splits evenly; `shard`: the
    shard ranks the groups are cut from (the valid degrees divide both)."""
    key = f"parallelism.expert={expert}"
    if isinstance(ep_plan, Mapping):  # the user's function: importable, taking the model
        from runner import components

        wrong = components.problems(PLAN_KEY, ep_plan, {"model": model})
        if wrong:
            return wrong
    try:
        named, unmatched = named_experts(model, ep_plan)
    except Exception as exc:  # the user's function failed on the model
        given = ep_plan.get("_target_") if isinstance(ep_plan, Mapping) else ep_plan
        return [f"{PLAN_KEY}: {given}(model) raised {type(exc).__name__}: {exc}"]
    found = [f"{PLAN_KEY}: {p!r} names no module of {type(model).__name__}" for p in unmatched]
    found += _unfit(named)
    from runner.models.families import family_of

    called = family_of(model).experts_key if ep_plan is None else None
    sizes = {}
    for name, module in named.items():
        size = stacked_experts(module)
        if size is not None:
            what = f"{called}={size}" if called else f"the {size} experts of {name}"
            sizes.setdefault(what, size)
    if expert == 1:  # nothing splits: only the user's plan is checked
        return found
    if not sizes and not found:
        return [
            f"{key}: {type(model).__name__} has no mixture-of-experts layer to split "
            "(model=gpt_moe has them; a Hugging Face MoE names its experts in its config's "
            "base_model_ep_plan; name a model's own with parallelism.ep_plan); use "
            "parallelism.expert=1"
        ]
    return (
        found
        + [
            f"{key}: must divide {what} (each rank of a group holds as many experts); "
            f"valid: {', '.join(str(d) for d in divisors(size) if shard is None or shard % d == 0)}"
            for what, size in sizes.items()
            if size % expert
        ][:1]
    )


def _unfit(named: dict[str, nn.Module]) -> list[str]:
    """The named modules expert parallelism cannot split, the first of each kind."""
    found = []
    flat = [f"{n} ({type(m).__name__})" for n, m in named.items() if stacked_experts(m) is None]
    if flat:
        more = f" (and {len(flat) - 1} more)" if len(flat) > 1 else ""
        found.append(
            f"{PLAN_KEY}: {flat[0]}{more} is no experts module of Hugging Face's shape "
            "(parameters stacked by expert on dim 0; forward(hidden_states, top_k_index, "
            "top_k_weights))"
        )
    return found


def apply_experts(model: nn.Module, mesh: Any, ep_plan: EpPlan = None) -> None:
    """Split every MoE layer's experts over `mesh` (the expert dimension), in place: this
    rank keeps its own as the local part of DTensors of the whole experts' shape."""
    degree, group = mesh.size(), mesh.get_group()
    for module in named_experts(model, ep_plan)[0].values():
        local = (stacked_experts(module) or degree) // degree
        _split(module, mesh, local)
        dispatch(module, group, local)


def _split(experts: nn.Module, mesh: Any, local: int) -> None:
    """`experts`' parameters, stacked by expert, as DTensors split over `mesh` by expert."""
    from torch.distributed.tensor import DTensor, Shard

    rank = mesh.get_local_rank()
    for name, param in list(experts.named_parameters(recurse=False)):
        own = param.detach()[rank * local : (rank + 1) * local].clone()
        split = DTensor.from_local(own, mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(split, requires_grad=param.requires_grad))
    setattr(experts, SPLIT, True)


def offered(model: nn.Module) -> bool:
    """Whether `model` has experts to split (runner.spec.mesh.DIMENSIONS)."""
    from runner.models.families import family_of

    return family_of(model).experts(model)["count"] > 0


def spec_problems(model: nn.Module, spec: Any) -> list[str]:
    """Expert parallelism's checks of a run's model (runner.spec.mesh.DIMENSIONS): its
    degree's, and a user's plan's even at 1."""
    options = spec.parallelism
    if spec.grid.expert == 1 and options.ep_plan is None:
        return []
    return expert_problems(model, spec.grid.expert, options.ep_plan, spec.grid.shard)
