"""Hugging Face's transformers models as a model family (a `PreTrainedModel`: a config that
saves itself): their tensor plan is their config's `base_model_tp_plan`, applied with
transformers' own styles; a decoder (Llama, Mistral, Qwen and most causal LMs) is cut into
pipeline stages by its `model.layers` (`model.embed_tokens` | `model.layers` | `model.norm`,
`lm_head`, with `model.rotary_emb` on every stage); a mixture of experts names its experts
modules in its config's `base_model_ep_plan`; training turns its generation cache off; and
an export writes its config and tokenizer beside the weights, under the Hub's names
(hugging_face_export.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.models.families.family import NO_EXPERTS, Cut, Family, TensorPlan

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn

    from runner.models.pipeline_stages import StageModule
    from runner.spec import RunSpec


class HuggingFaceFamily(Family):
    name = "hugging_face"
    order = 30

    def claims(self, model: nn.Module) -> bool:
        config = getattr(model, "config", None)
        return config is not None and hasattr(config, "save_pretrained")

    def builds(self, target: str) -> bool:
        """`transformers.LlamaForCausalLM` and the like (a class of transformers' own)."""
        package, _, name = target.partition(".")
        return package == "transformers" and name.isidentifier() and name[:1].isupper()

    def preloads(self, target: str, device: str) -> list[str]:
        """On the CPU the model's class (`transformers:LlamaForCausalLM`: the module, then
        the attribute, loaded on first use): transformers' import and its modeling module's,
        about 2 s of CPU a rank here, made once in the fork server. On a GPU the ranks'."""
        return [":".join(target.rsplit(".", 1))] if device == "cpu" else []

    def heads(self, model: nn.Module) -> int | None:
        heads = getattr(model.config, "num_attention_heads", None)
        return heads if isinstance(heads, int) else None

    def tensor_plan(self, model: nn.Module, split_logits: bool) -> TensorPlan | None:
        return apply_hugging_face_plan if hugging_face_plan(model) else None

    def tensor_problems(self, model: nn.Module, tensor: int) -> list[str]:
        return hugging_face_problems(model, tensor)

    def pipeline_cut(self, model: nn.Module) -> Cut | None:
        return Cut(
            "model.layers",
            ("model.embed_tokens",),
            ("model.norm", "lm_head"),
            ("model.rotary_emb",),
            _stage_forward,
            problems=_cut_problems,
        )

    def experts(self, model: nn.Module) -> dict[str, int]:
        from runner.models.expert_dispatch import stacked_experts
        from runner.models.expert_split import named_experts

        try:
            named = named_experts(model, None)[0]
        except Exception:  # a plan that names nothing this model has
            named = {}
        modules = [m for m in named.values() if stacked_experts(m)]
        if not modules:
            return dict(NO_EXPERTS)
        count = stacked_experts(modules[0]) or 0
        top_k = int(getattr(model.config, "num_experts_per_tok", 1) or 1)
        width = int(getattr(model.config, "hidden_size", 0) or 0)
        elements = sum(p.numel() for m in modules for p in m.parameters())
        return {"count": count, "elements": elements, "routed": top_k * width}

    def expert_patterns(self, model: nn.Module) -> list[str]:
        return expert_patterns(model)

    def ready_to_train(self, model: nn.Module) -> str | None:
        """Its key/value cache off (`config.use_cache`): nothing reads it in training, and a
        block that activation checkpointing runs again would meet the cache the first pass
        filled (torch.utils.checkpoint refuses the difference). The config a user exports
        keeps its own value (runner.export)."""
        if getattr(model.config, "use_cache", None) is not True:
            return None
        model.config.use_cache = False
        return "use_cache=false for training (the generation cache; exports keep it)"

    export_kind = ", a Hugging Face model"

    def exported(self, model: nn.Module, tensors: list[Any]) -> list[Any]:
        from runner.models.families.hugging_face_export import hub_names, tied_names

        left_out = tied_names(model)
        return hub_names(model, [t for t in tensors if t.name not in left_out])

    def export_beside(self, model: nn.Module, spec: RunSpec, to: Path) -> list[Path]:
        from runner.models.families.hugging_face_export import copy_tokenizer, write_config

        return write_config(model, to) + copy_tokenizer(spec, to)


FAMILY = HuggingFaceFamily()


def expert_patterns(model: nn.Module) -> list[str]:
    """Its experts modules by its config's base_model_ep_plan (under the model's prefix); []
    where it has none."""
    from torch import nn

    from runner.models.expert_dispatch import DISPATCHED

    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    names = [name for name, style in plan.items() if style == DISPATCHED]
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        names = [f"{prefix}.{name}" for name in names]
    return names


def _stage_forward(stage: StageModule, x: torch.Tensor) -> torch.Tensor:
    """A decoder's stage: causal attention from its implementation (sdpa, flash) with no
    mask; every stage computes the rotary embedding of the positions itself."""
    import torch

    body = stage.model
    if stage.first:
        x = body.embed_tokens(x)
    positions = torch.arange(x.shape[1], device=x.device)[None]
    rotary = body.rotary_emb(x, positions)
    for layer in body.layers.values():
        x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        x = x[0] if isinstance(x, tuple) else x
    return stage.lm_head(body.norm(x)) if stage.last else x


def _cut_problems(model: nn.Module) -> list[str]:
    name, config = type(model).__name__, getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        return [
            f"parallelism.pipeline: {name} ties its head to its embeddings, which go to the "
            "first and the last stage; untie them (model.config.tie_word_embeddings=false)"
        ]
    if getattr(config, "_attn_implementation", None) == "eager":
        return [
            f"parallelism.pipeline: {name} runs eager attention, which takes its causal mask "
            "from the model's forward; use its sdpa or flash attention"
        ]
    return []


def hugging_face_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's own plan (its config's base_model_tp_plan, under the model's
    prefixes), by module pattern; {} where it has none. A mixture of experts' experts
    modules (its base_model_ep_plan's) are left out: each tensor rank runs the whole
    experts on the sequence it holds whole (expert parallelism splits them), as runner's
    gpt_moe does; transformers' experts styles trained other weights than one process."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not isinstance(plan, dict):
        return {}
    experts = expert_patterns(model)
    return {
        name: style
        for name, style in plan.items()
        if not any(name == e or name.startswith(f"{e}.") for e in experts)
    }


def hugging_face_problems(model: nn.Module, tensor: int) -> list[str]:
    """What a transformers plan needs: every module it names, head counts and every split
    size divisible by the group."""
    import difflib

    from runner.models.module_names import expand_patterns

    key = f"parallelism.tensor={tensor}"
    if _hugging_face_styles() is None:
        from importlib.metadata import version

        return [
            f"{key}: a Hugging Face model is split with transformers' own tensor-parallel "
            f"styles (transformers.distributed.tensor_parallel), which transformers "
            f"{version('transformers')} does not have; upgrade transformers, or use "
            "parallelism.tensor=1"
        ]
    expanded, unmatched = expand_patterns(model, hugging_face_plan(model))
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
    from runner.models.module_names import expand_patterns

    apply_tensor_parallelism = _hugging_face_styles()
    expanded, _ = expand_patterns(model, hugging_face_plan(model))
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
