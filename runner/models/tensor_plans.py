"""Tensor-parallel plans: how a model's layers split across the ranks of a tensor group
(torch.distributed.tensor.parallel), and what a plan needs of the model's sizes.

A model family brings its own plan (runner.models.families: runner's gpt Megatron's layout,
with sequence parallelism between, a Hugging Face model its `base_model_tp_plan` applied
with transformers' styles). A model of the user's brings a plan as a component:
`parallelism.tp_plan._target_` names a function `plan(model, mesh)` that calls
`parallelize_module` on the model's modules (its other keys are passed to it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

PlanFunction = Callable[[nn.Module, Any], None]


PLAN_KEY = "parallelism.tp_plan"


def plan_for(
    model: nn.Module, node: dict[str, Any] | None = None, split_logits: bool = False
) -> PlanFunction | None:
    """The plan that splits `model`: the user's (`node`, parallelism.tp_plan), else its
    family's; None where there is none. `split_logits`: the loss runs on logits split by
    vocabulary, so a plan that can leave them so (the gpt's) does; the others gather them."""
    import functools

    from runner.models.families import family_of

    if node:
        from runner.components import TARGET, locate

        options = {k: v for k, v in node.items() if not k.startswith("_")}
        return functools.partial(locate(str(node[TARGET])), **options)
    return family_of(model).tensor_plan(model, split_logits)


def plan_problems(model: nn.Module, tensor: int, node: dict[str, Any] | None = None) -> list[str]:
    """Why `model` cannot be split across `tensor` ranks (before any rank starts)."""
    from runner.models.families import family_of

    if node:  # the user's: importable, and taking the model and the mesh
        from runner import components

        return components.problems(PLAN_KEY, node, {"model": model, "mesh": None})
    if plan_for(model) is None:
        return [
            f"parallelism.tensor={tensor}: {type(model).__name__} has no tensor-parallel plan "
            "(runner's gpt has one, as do Hugging Face models with a base_model_tp_plan); "
            "use parallelism.tensor=1"
        ]
    return family_of(model).tensor_problems(model, tensor)


def apply_plan(
    model: nn.Module, mesh: Any, node: dict[str, Any] | None = None, split_logits: bool = False
) -> None:
    """Split `model` across the tensor dimension `mesh` by its plan (or the user's); see
    plan_for for `split_logits`."""
    plan = plan_for(model, node, split_logits)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan")
    plan(model, mesh)


def offered(model: nn.Module) -> bool:
    """Whether `model`'s family has a tensor plan (runner.spec.mesh.DIMENSIONS)."""
    return plan_for(model) is not None


def spec_problems(model: nn.Module, spec: Any) -> list[str]:
    """Tensor parallelism's checks of a run's model (runner.spec.mesh.DIMENSIONS)."""
    if spec.grid.tensor == 1:
        return []
    return plan_problems(model, spec.grid.tensor, spec.parallelism.tp_plan)
