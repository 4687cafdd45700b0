"""What a model offers to be split by: the splits it has plans of its own for (tensor,
pipeline, context parallelism) and its mixture-of-experts layers (expert parallelism),
asked of the model itself (its classes, its config), never of its name."""

from __future__ import annotations

from torch import nn

NO_EXPERTS = {"count": 0, "elements": 0, "routed": 0}


def model_splits(model: nn.Module) -> list[str]:
    """The splits `model` has plans of its own for: a tensor plan (runner's gpt and gpt_moe,
    a Hugging Face model's base_model_tp_plan), a pipeline cut (their layers), context
    parallelism's sequence hook (runner's gpt), experts to split (a mixture of experts); a
    candidate of each is still checked as a run would be."""
    from runner.models.context_split import context_problems
    from runner.models.pipeline_stages import cut_of
    from runner.models.tensor_plans import plan_for

    found = []
    if plan_for(model) is not None:
        found.append("tensor")
    if cut_of(model) is not None:
        found.append("pipeline")
    if not context_problems(model, 2):
        found.append("context")
    if experts_of(model)["count"]:
        found.append("expert")
    return found


def experts_of(model: nn.Module) -> dict[str, int]:
    """`model`'s experts (NO_EXPERTS where it has none): runner's MoE layers, or the experts
    modules of a Hugging Face mixture of experts (its config's base_model_ep_plan)."""
    from runner.models.expert_dispatch import stacked_experts
    from runner.models.expert_split import moe_layers, named_experts

    layers = moe_layers(model)
    if layers:
        modules = [layer.experts for layer in layers]
        count, top_k = layers[0].n_experts, layers[0].top_k
        width = layers[0].router.in_features
    else:
        try:
            named = named_experts(model, None)[0]
        except Exception:  # a plan that names nothing this model has
            named = {}
        modules = [m for m in named.values() if stacked_experts(m)]
        if not modules:
            return dict(NO_EXPERTS)
        config = getattr(model, "config", None)
        count = stacked_experts(modules[0]) or 0
        top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
        width = int(getattr(config, "hidden_size", 0) or 0)
    elements = sum(p.numel() for m in modules for p in m.parameters())
    return {"count": count, "elements": elements, "routed": top_k * width}
