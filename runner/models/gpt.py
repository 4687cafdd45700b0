"""A small decoder-only transformer (nanoGPT scale), built in so language modelling works
out of the box: `model=gpt`. Its layers are a `blocks` ModuleList, the unit that
activation checkpointing and sharding work on.

`forward(input_ids, attention_mask=None)` returns logits [batch, time, vocab_size];
`vocab_size` and `block_size` come from the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. `qkv`'s output rows are grouped by head (head 0's
    query, key and value, then head 1's, ...), so that a contiguous slice of them holds whole
    heads: tensor parallelism splits it column-wise, each rank computing its own heads, and
    the forward pass reads the head count from the width it is given."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd}: must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.head_size = n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.sequence: Any = WHOLE_SEQUENCE  # how this rank's positions attend (see GPT)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        batch, time = x.shape[:2]
        qkv = self.qkv(x).view(batch, time, -1, 3, self.head_size)  # this rank's heads
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        dropout = self.dropout if self.training else 0.0
        y = self.sequence.attend(q, k, v, dropout, key_mask)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a 4x MLP, each around a residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), key_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    residual_outputs: tuple[str, ...] = ("attn.proj.weight", "mlp.2.weight")
    """The weights that write into the residual stream: initialised smaller (GPT-2's)."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = False,
        block: Callable[[int], nn.Module] | None = None,
    ):
        """`block(i)`: layer i (a model built on the gpt: gpt_moe), by default a `Block`."""
        super().__init__()
        self.block_size = block_size
        # a tensor-parallel plan splits the sequence across its group: padded to a multiple
        self.sequence_multiple = 1
        # which positions this rank computes, and how they attend: the whole sequence, or a
        # split of it across ranks set in its place (with each attention's)
        self.sequence: Any = WHOLE_SEQUENCE
        self.n_layer, self.n_embd = n_layer, n_embd
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        block = block or (lambda _: Block(n_embd, n_head, dropout, bias))
        self.blocks = nn.ModuleList(block(i) for i in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2's scaled init of residual outputs
            if name.endswith(self.residual_outputs):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def flops_per_token(self) -> float:
        """Training FLOPs per token at full context, as torchtitan and LLM Foundry count
        them: 6 per parameter that multiplies (forward 2, backward 4; the embedding tables
        only look up), plus attention's scores and weighted sum, 2 x 2 x block_size x n_embd
        per layer forward, x3 with backward (the causal mask's skipped half counted, as
        PaLM's appendix does)."""
        from runner.models.shapes import multiplying_parameters

        dense = multiplying_parameters(self)
        return 6.0 * dense + 12.0 * self.n_layer * self.n_embd * self.block_size

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        time = input_ids.shape[1]
        if time > self.block_size:
            raise ValueError(
                f"a sequence of {time} tokens is longer than block_size={self.block_size}"
            )
        pad = -time % (self.sequence_multiple * self.sequence.multiple)
        if pad:  # at the end, where causal attention keeps every real position from seeing it
            input_ids = F.pad(input_ids, (0, pad))
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (0, pad))
        input_ids, positions, key_mask = self.sequence.take(input_ids, attention_mask)
        positions = positions.clamp(max=self.block_size - 1)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x, key_mask)
        return self.sequence.output(self.lm_head(self.ln_f(x)), time)


class WholeSequence:
    """How a gpt runs its sequence on one rank: every position, causal attention (with the
    padding mask a batch brings). A split of the sequence across ranks puts an object with
    the same three members in its place (runner.models.context_split)."""

    multiple = 1  # the padded sequence's length is a multiple of this

    def take(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the tokens this rank computes, their positions, the attention mask)."""
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)
        key_mask = _key_mask(attention_mask, length) if attention_mask is not None else None
        return input_ids, positions, key_mask

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout: float,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if key_mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=dropout)

    def output(self, logits: torch.Tensor, time: int) -> torch.Tensor:
        """The logits of the `time` positions the batch gave (the padding cut off)."""
        return logits[:, :time] if logits.shape[1] > time else logits


WHOLE_SEQUENCE = WholeSequence()


def _key_mask(attention_mask: torch.Tensor, time: int) -> torch.Tensor:
    """Causal and padding mask [batch, 1, time, time]; a position always sees itself, so a
    padded query never has an empty row (its output is ignored by the loss anyway)."""
    causal = torch.ones(time, time, dtype=torch.bool, device=attention_mask.device).tril()
    keys = attention_mask.bool()[:, None, None, :]
    eye = torch.eye(time, dtype=torch.bool, device=attention_mask.device)
    return (causal & keys) | eye
