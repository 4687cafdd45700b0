"""runner's gpt with mixture-of-experts layers in place of its MLPs: `model=gpt_moe`.

Every block's MLP becomes a `MoE` layer (runner.models.moe): `n_experts` experts, `top_k`
of them per token, `n_shared_experts` that every token goes through. An expert's hidden
width is `expert_hidden`, by default the dense gpt's 4 x n_embd shared among the experts
a token uses (top_k + n_shared_experts): the same active parameters per token as the gpt
of the same n_embd, with n_experts / top_k times its MLP parameters in all.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.models.gpt import GPT, CausalSelfAttention
from runner.models.moe import MoE


class MoEBlock(nn.Module):
    """Pre-norm transformer block: attention, then a mixture of experts, each around a
    residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, moe: MoE):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.moe = moe

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), key_mask)
        return x + self.moe(self.ln_2(x))


class GPTMoE(GPT):
    residual_outputs = (*GPT.residual_outputs, "experts.w2", "shared.2.weight")

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = False,
        n_experts: int = 8,
        top_k: int = 2,
        n_shared_experts: int = 0,
        expert_hidden: int | None = None,
        score: str = "softmax",
        normalize_gates: bool | None = None,
        capacity_factor: float | None = None,
        aux_loss_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        bias_update_speed: float = 0.0,
    ):
        if expert_hidden is None:
            expert_hidden = max(1, 4 * n_embd // max(1, top_k + n_shared_experts))
        if expert_hidden < 1:
            raise ValueError(f"model.expert_hidden={expert_hidden}: must be at least 1")

        def block(index: int) -> nn.Module:
            moe = MoE(
                n_embd, n_experts, top_k, expert_hidden, n_shared=n_shared_experts,
                score=score, normalize_gates=normalize_gates, capacity_factor=capacity_factor,
                aux_loss_weight=aux_loss_weight, z_loss_weight=z_loss_weight,
                bias_update_speed=bias_update_speed, dropout=dropout,
            )  # fmt: skip
            moe.state.layer, moe.state.layers = index, n_layer
            return MoEBlock(n_embd, n_head, dropout, bias, moe)

        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, block)
        self.n_experts, self.top_k = n_experts, top_k

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        mask = attention_mask
        pad = -input_ids.shape[1] % (self.sequence_multiple * self.sequence.multiple)
        if pad:  # the gpt pads the sequence at its end (tensor, context parallelism)
            mask = torch.ones_like(input_ids) if mask is None else mask
            mask = torch.nn.functional.pad(mask, (0, pad))
        for block in self.blocks:  # padding counts in no expert's tokens, no balance loss
            block.moe.state.token_mask = mask
        return super().forward(input_ids, attention_mask)

    def flops_per_token(self) -> float:
        """The gpt's count (runner.models.gpt) over the parameters a token uses: of each
        layer's experts, the top_k it is routed to."""
        unused = sum(
            block.moe.experts.w1.numel() + block.moe.experts.w2.numel() for block in self.blocks
        ) * (1 - self.top_k / self.n_experts)
        return super().flops_per_token() - 6.0 * unused
