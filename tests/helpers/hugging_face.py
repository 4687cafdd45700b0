"""A tiny GPT-2 from transformers' own classes (built from its config: no download), and
the overrides that train it on a small text corpus."""

from __future__ import annotations

from pathlib import Path

GPT2 = {"vocab_size": 256, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}


def text_corpus(root: Path) -> Path:
    folder = root / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    return folder


def gpt2_args(corpus: Path) -> list[str]:
    return _causal_lm_args("GPT2LMHeadModel", "GPT2Config", GPT2, corpus)


def _causal_lm_args(model: str, config: str, values: dict, corpus: Path) -> list[str]:
    """A transformers causal LM built from its config class, trained on `corpus`."""
    args = ["model=custom", f"model._target_=transformers.{model}"]
    args += [f"+model.config._target_=transformers.{config}"]
    args += [f"+model.config.{k}={v}" for k, v in values.items()]
    args += ["data=text", f"data.root={corpus}", "data.block_size=32", "data.min_length=8"]
    return args + ["loss=causal_lm", "metrics=language_model", "global_batch_size=8"]


# A tiny Llama (grouped-query attention: 4 heads, 2 key-value heads), also from its config.
LLAMA = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def llama_args(corpus: Path) -> list[str]:
    return _causal_lm_args("LlamaForCausalLM", "LlamaConfig", LLAMA, corpus)


# Tiny mixtures of experts from transformers' classes: 4 experts, 2 per token, stacked by
# transformers 5 in one experts module per layer (`mlp.experts.gate_up_proj` [4, 2I, H]).
MOE_BASE = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}
MIXTRAL = {**MOE_BASE, "intermediate_size": 48, "num_local_experts": 4}
QWEN2_MOE = {  # shared expert beside the routed ones
    **MOE_BASE,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 24,
    "num_experts": 4,
    "qkv_bias": False,  # a key bias has a zero gradient that AdamW turns into noise
}
OLMOE = {**MOE_BASE, "intermediate_size": 24, "num_experts": 4}
MOE_MODELS = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", MIXTRAL),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", QWEN2_MOE),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", OLMOE),
}


def moe_args(kind: str, corpus: Path) -> list[str]:
    return _causal_lm_args(*MOE_MODELS[kind], corpus)


def experts_of(model, suffix: str = "mlp.experts") -> list[str]:
    """An ep_plan function (parallelism.ep_plan._target_): the experts modules by name."""
    return [name for name, _ in model.named_modules() if name.endswith(suffix)]
