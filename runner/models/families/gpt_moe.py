"""runner's gpt_moe (runner.models.gpt_moe) as a model family: the gpt's (families/gpt.py),
with a mixture of experts in each block in place of its MLP. Its tensor plan leaves the
experts whole (each rank of a tensor group routes the gathered sequence through whole
experts); expert parallelism splits every layer's `moe.experts` by the dispatch a Hugging
Face MoE's experts take (runner.models.expert_dispatch); its balance losses are means over
whole sequences, which a context split would cut across ranks.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from runner.models.families.family import TensorPlan
from runner.models.families.gpt import GptFamily, gpt_plan

if TYPE_CHECKING:
    from torch import nn


class GptMoeFamily(GptFamily):
    name = "gpt_moe"
    order = 10  # before the gpt it is built on
    module = "runner.models.gpt_moe"

    def claims(self, model: nn.Module) -> bool:
        from runner.models.gpt_moe import GPTMoE

        return isinstance(model, GPTMoE)

    def tensor_plan(self, model: nn.Module, split_logits: bool) -> TensorPlan | None:
        return functools.partial(gpt_plan, split_logits=split_logits, experts=True)

    def context_problems(self, model: nn.Module, context: int) -> list[str]:
        if any(block.moe.balance_losses for block in model.blocks):
            return [
                f"parallelism.context={context}: the balance losses of runner's gpt_moe are "
                "means over whole sequences, which a context split cuts across ranks; set "
                "model.aux_loss_weight=0 and model.z_loss_weight=0 (model.bias_update_speed "
                "balances without a loss), or parallelism.context=1"
            ]
        return []

    experts_key = "model.n_experts"

    def expert_patterns(self, model: nn.Module) -> list[str]:
        return ["blocks.*.moe.experts"]

    def experts(self, model: nn.Module) -> dict[str, Any]:
        first = model.blocks[0].moe
        elements = sum(p.numel() for b in model.blocks for p in b.moe.experts.parameters())
        routed = first.top_k * first.router.in_features
        return {"count": first.n_experts, "elements": elements, "routed": routed}


FAMILY = GptMoeFamily()
