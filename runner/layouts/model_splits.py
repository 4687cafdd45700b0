"""What a model offers to be split by: the splits it has plans of its own for (tensor,
pipeline, context parallelism) and its mixture-of-experts layers (expert parallelism),
asked of its family (runner.models.families), never of its name."""

from __future__ import annotations

from torch import nn


def model_splits(model: nn.Module) -> list[str]:
    """The splits `model` has plans of its own for: a tensor plan (runner's gpt and gpt_moe,
    a Hugging Face model's base_model_tp_plan), a pipeline cut (their layers), context
    parallelism's sequence hook (runner's gpt), experts to split (a mixture of experts); a
    candidate of each is still checked as a run would be."""
    from runner.models.context_split import context_problems
    from runner.models.families import family_of
    from runner.models.pipeline_stages import cut_of
    from runner.models.tensor_plans import plan_for

    found = []
    if plan_for(model) is not None:
        found.append("tensor")
    if cut_of(model) is not None:
        found.append("pipeline")
    if not context_problems(model, 2):
        found.append("context")
    if family_of(model).experts(model)["count"]:
        found.append("expert")
    return found
