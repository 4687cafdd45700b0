"""Model families: each kind of model runner knows is claimed by its own declaration (built,
or by the `_target_` that builds it), and a model none claims is the generic family's; what
parallelize(), preflight, the planner and export ask is answered there."""

from __future__ import annotations

import pytest
import torch
import transformers

from runner.models.families import family_of, family_of_target
from runner.models.gpt import GPT
from runner.models.gpt_moe import GPTMoE
from tests.helpers.hugging_face import LLAMA, MIXTRAL


def _meta(build):
    with torch.device("meta"):
        return build()


def test_each_model_is_claimed_by_its_family() -> None:
    from runner.models.builders import mlp, resnet18

    gpt = _meta(lambda: GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    moe = _meta(lambda: GPTMoE(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    llama = _meta(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)))
    mixtral = _meta(lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL)))
    resnet = _meta(lambda: resnet18(num_classes=10))
    own = mlp(input_shape=(1, 8, 8), num_classes=10)
    kinds = [gpt, moe, llama, mixtral, resnet, own]
    assert [family_of(m).name for m in kinds] == [
        "gpt", "gpt_moe", "hugging_face", "hugging_face", "vision", "generic"
    ]  # fmt: skip
    # what each says of itself: the splits it has plans for, its heads, its experts
    assert [family_of(m).heads(m) for m in kinds] == [2, 2, 4, 4, None, None]
    assert [family_of(m).pipeline_cut(m) is not None for m in kinds] == [
        True, True, True, True, False, False
    ]  # fmt: skip
    assert [family_of(m).experts(m)["count"] for m in kinds] == [0, 8, 0, 4, 0, 0]
    assert [not family_of(m).context_problems(m, 2) for m in kinds] == [
        True, False, False, False, False, False
    ]  # gpt_moe's balance losses are means over whole sequences  # fmt: skip
    assert family_of(llama).ready_to_train(llama) == (
        "use_cache=false for training (the generation cache; exports keep it)"
    )
    assert llama.config.use_cache is False and family_of(llama).ready_to_train(llama) is None


@pytest.mark.parametrize(
    ("target", "family", "preloads"),
    [
        ("runner.models.gpt.GPT", "gpt", []),
        ("runner.models.gpt_moe.GPTMoE", "gpt_moe", []),
        ("transformers.LlamaForCausalLM", "hugging_face", ["transformers:LlamaForCausalLM"]),
        ("runner.models.builders.resnet50", "vision", ["torchvision.models"]),
        ("torchvision.models.resnet18", "vision", []),
        ("runner.models.builders.mlp", "generic", []),
        ("my_package.models.Net", "generic", []),
    ],
)
def test_a_target_is_claimed_before_the_model_is_built(
    target: str, family: str, preloads: list[str]
) -> None:
    """Before any rank starts: which modules the fork server may import for the ranks, and
    whether building the model on the meta device checks its options (runner's gpt's)."""
    found = family_of_target(target)
    assert found.name == family
    assert found.preloads(target, "cpu") == preloads
    assert found.checks_itself == family.startswith("gpt")
