"""Tensor-parallel plans: how a model's layers split across the ranks of a tensor group
(torch.distributed.tensor.parallel), and what a plan needs of the model's sizes.

runner's gpt ships its plan, Megatron's layout with sequence parallelism between:
- the token and position embeddings split by rows (vocabulary, positions), their sum
  scattered along the sequence;
- in each block, the norms run on the rank's part of the sequence (sequence parallel);
  attention and the MLP gather it, their first layers (qkv, mlp.0) split column-wise (each
  rank its own heads, its own part of the hidden width) and their last (proj, mlp.2)
  row-wise, reduced and scattered back along the sequence;
- gpt_moe's mixture of experts in place of the MLP: not split; each rank routes the whole
  gathered sequence through whole experts and keeps its part of the output;
- the final norm sequence-parallel, the head column-wise; its logits stay split by
  vocabulary where the loss runs on them so (loss parallel: runner.engines.loss_parallel),
  else they are gathered whole.

A Hugging Face model uses its own plan (`base_model_tp_plan`, applied with transformers'
styles). A model of the user's brings a plan as a component: `parallelism.tp_plan._target_`
names a function `plan(model, mesh)` that calls `parallelize_module` on the model's modules
(its other keys are passed to it).
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
    """The plan that splits `model`: the user's (`node`, parallelism.tp_plan), else the
    model's own; None where there is none. `split_logits`: the loss runs on logits split by
    vocabulary, so a plan that can leave them so (the gpt's) does; the others gather them."""
    import functools

    from runner.models.gpt import GPT

    if node:
        from runner.components import TARGET, locate

        options = {k: v for k, v in node.items() if not k.startswith("_")}
        return functools.partial(locate(str(node[TARGET])), **options)
    if isinstance(model, GPT):
        return functools.partial(gpt_plan, split_logits=split_logits)
    if hugging_face_plan(model):
        return apply_hugging_face_plan
    return None


def plan_problems(model: nn.Module, tensor: int, node: dict[str, Any] | None = None) -> list[str]:
    """Why `model` cannot be split across `tensor` ranks (before any rank starts)."""
    from runner.models.gpt import GPT

    if node:  # the user's: importable, and taking the model and the mesh
        from runner import components

        return components.problems(PLAN_KEY, node, {"model": model, "mesh": None})
    if plan_for(model) is None:
        return [
            f"parallelism.tensor={tensor}: {type(model).__name__} has no tensor-parallel plan "
            "(runner's gpt has one, as do Hugging Face models with a base_model_tp_plan); "
            "use parallelism.tensor=1"
        ]
    if isinstance(model, GPT):
        return gpt_problems(model, tensor)
    return hugging_face_problems(model, tensor)


def hugging_face_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's own plan (its config's base_model_tp_plan, under the model's
    prefixes), by module pattern; {} where it has none. A mixture of experts' experts
    modules (its base_model_ep_plan's) are left out: each tensor rank runs the whole
    experts on the sequence it holds whole (expert parallelism splits them), as runner's
    gpt_moe does; transformers' experts styles trained other weights than one process."""
    from runner.models.expert_dispatch import hugging_face_ep_plan

    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not isinstance(plan, dict):
        return {}
    experts = hugging_face_ep_plan(model)
    return {
        name: style
        for name, style in plan.items()
        if not any(name == e or name.startswith(f"{e}.") for e in experts)
    }


def expand_plan(model: nn.Module, plan: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The plan by module (or parameter) name, `*` standing for a layer number; and the
    patterns that name nothing in the model."""
    import re

    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    expanded: dict[str, str] = {}
    unmatched = []
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        hits = [name for name in names if regex.fullmatch(name)]
        if not hits:
            unmatched.append(pattern)
        expanded.update(dict.fromkeys(hits, style))
    return expanded, unmatched


def hugging_face_problems(model: nn.Module, tensor: int) -> list[str]:
    """What a transformers plan needs: every module it names, head counts and every split
    size divisible by the group."""
    import difflib

    key = f"parallelism.tensor={tensor}"
    if _hugging_face_styles() is None:
        from importlib.metadata import version

        return [
            f"{key}: a Hugging Face model is split with transformers' own tensor-parallel "
            f"styles (transformers.distributed.tensor_parallel), which transformers "
            f"{version('transformers')} does not have; upgrade transformers, or use "
            "parallelism.tensor=1"
        ]
    expanded, unmatched = expand_plan(model, hugging_face_plan(model))
    modules = [n for n, _ in model.named_modules() if n]
    problems = []
    for pattern in unmatched:
        alike = difflib.get_close_matches(pattern, modules, n=4, cutoff=0.3)
        problems.append(
            f"{key}: the plan names {pattern}, which {type(model).__name__} does not have "
            f"(it has {', '.join(alike) or 'nothing alike'})"
        )
    config = getattr(model, "config", None)
    for count in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, count, None)
        if isinstance(value, int) and value % tensor:
            problems.append(f"{key}: must divide model config {count}={value}")
    split_dim = {"colwise": 0, "colwise_gather_output": 0, "rowwise": 1, "embedding_rowwise": 0}
    named = dict(model.named_modules())
    for name, style in expanded.items():
        weight = getattr(named.get(name), "weight", None)
        dim = split_dim.get(style)
        if weight is not None and dim is not None and weight.shape[dim] % tensor:
            problems.append(f"{key}: must divide {name}'s size {weight.shape[dim]} (split {style})")
    return problems


def _hugging_face_styles() -> Any:
    """transformers' function that applies a plan's styles, where this transformers has it."""
    try:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError:
        return None
    return apply_tensor_parallelism


def apply_hugging_face_plan(model: nn.Module, mesh: Any) -> None:
    """A transformers model split by its own plan, with transformers' own styles."""
    apply_tensor_parallelism = _hugging_face_styles()
    expanded, _ = expand_plan(model, hugging_face_plan(model))
    modules = dict(model.named_modules())
    with_parameters: dict[str, str] = {}
    for name, style in expanded.items():  # a module's own parameters split first (its
        if name not in modules:  # loading path's job); a parameter the plan names itself
            with_parameters[name] = style
            continue
        for param, _ in modules[name].named_parameters(recurse=False):
            with_parameters[f"{name}.{param}"] = style
        with_parameters[name] = style  # then its forward
    apply_tensor_parallelism(model, mesh, with_parameters)


def apply_plan(
    model: nn.Module, mesh: Any, node: dict[str, Any] | None = None, split_logits: bool = False
) -> None:
    """Split `model` across the tensor dimension `mesh` by its plan (or the user's); see
    plan_for for `split_logits`."""
    plan = plan_for(model, node, split_logits)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan")
    plan(model, mesh)


def gpt_problems(model: nn.Module, tensor: int, key: str = "parallelism.tensor") -> list[str]:
    """What runner's gpt plan needs: every size it splits divisible by the group."""
    first = model.blocks[0].attn
    sizes = {
        "model.n_head": first.n_head,
        "model.n_embd": model.n_embd,
        "the vocabulary (data's vocab_size)": model.wte.num_embeddings,
    }
    return [
        f"{key}={tensor}: must divide {name}={size} (the gpt's plan splits it across the "
        f"tensor group)"
        for name, size in sizes.items()
        if size % tensor
    ]


def gpt_plan(model: nn.Module, mesh: Any, split_logits: bool = False) -> None:
    """runner's gpt across the ranks of `mesh` (the tensor dimension): see the module text.
    `split_logits`: the head's logits stay split by vocabulary (a DTensor, for a loss that
    runs on them so: loss parallel), else they are gathered whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # The residual stream stays a DTensor split along the sequence (use_local_output=False);
    # the gpt pads its sequence to a multiple of the group, so every rank holds an equal part
    # (an uneven split broke torch 2.11's DTensor linear, and compiled blocks at a second
    # length: each rank compiled its own, and their collectives disagreed in size).
    model.sequence_multiple = mesh.size()
    sequence, gathered = Shard(1), Replicate()
    head = (
        ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False)
        if split_logits
        else ColwiseParallel(input_layouts=sequence, output_layouts=gathered)
    )
    parallelize_module(
        model,
        mesh,
        {
            "wte": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=sequence, use_local_output=False
            ),
            "wpe": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False
            ),
            "ln_f": SequenceParallel(),
            "lm_head": head,
        },
    )
    for block in model.blocks:
        parallelize_module(block, mesh, _gpt_block_plan(experts=hasattr(block, "moe")))


def _gpt_block_plan(experts: bool = False) -> dict[str, Any]:
    """A gpt block's layers: norms on the rank's part of the sequence, attention and the MLP
    on all of it, their first layers split by columns, their last by rows (reduced and
    scattered back along the sequence). A mixture of experts (gpt_moe's `moe`) is not
    split: every rank of the group routes and computes the whole sequence (gathered) with
    whole experts, and keeps its part of the output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    sequence, gathered = Shard(1), Replicate()
    attention = {
        "ln_1": SequenceParallel(),
        "attn": PrepareModuleInput(
            input_layouts=(sequence, None), desired_input_layouts=(gathered, None)
        ),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        "ln_2": SequenceParallel(),
    }
    if experts:
        moe = PrepareModuleInputOutput(
            input_layouts=(sequence,), desired_input_layouts=(gathered,), use_local_input=True,
            output_layouts=(gathered,), desired_output_layouts=(sequence,),
            use_local_output=False,
        )  # fmt: skip
        return attention | {"moe": moe}
    return attention | {
        "mlp": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(gathered,)),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=sequence, use_local_output=False),
    }
