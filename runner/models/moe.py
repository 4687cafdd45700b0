"""A mixture-of-experts layer: a router picks `top_k` of `n_experts` MLPs for each token,
and the token's output is their outputs weighted by the router's gates (plus, optionally,
shared experts that every token goes through).

- **Routing.** The router's scores are a softmax (Switch, Mixtral) or a sigmoid
  (DeepSeek-V3) of its logits, computed in fp32. The gates of a token's chosen experts are
  their scores, normalized to sum to one where `normalize_gates` (by default: with
  top_k > 1).
- **Dropless by default:** every token reaches its experts. With `capacity_factor=c`, an
  expert takes at most ceil(c x tokens x top_k / n_experts) of a microbatch's tokens, the
  first in token order, and the rest of its assignments are dropped (the residual carries
  those tokens) and counted. The shapes stay fixed: a dropped assignment is computed and
  weighted by zero, so no step waits for the host to count.
- **Balance.** The load-balancing loss is DeepSeek-V3's sequence-wise one: per sequence,
  n_experts x sum over experts of (the share of its assignments the expert got) x (its mean
  score), which is 1 when a sequence spreads evenly; the router's z-loss is the mean square
  of the logits' logsumexp. Both are means over the global batch's sequences: every split
  of a batch across ranks and microbatches trains alike. They reach the gradient without
  going through the loss: `attach` hands each its weight in the backward pass (the trainer
  says what one sequence weighs this step: `Routing`, runner.train.step.routing). Or the
  auxiliary-loss-free way (DeepSeek-V3, torchtitan): a per-expert bias added to the scores
  for choosing only, moved after each step by `bias_update_speed` toward the experts that
  got fewer than their share of the step's tokens (the counts of the whole global batch).
- **Experts** are held stacked (`w1` [experts, n_embd, hidden], `w2` [experts, hidden,
  n_embd]), so a rank can hold a slice of them, in one module that keeps transformers'
  experts contract (hidden states, each token's top-k experts and their weights), so expert
  parallelism splits runner's experts and a Hugging Face model's alike
  (runner.models.expert_dispatch). Their tokens are sorted by expert and run
  through torch's grouped matrix product where torch has one for the device (CUDA from
  Hopper in bf16; the CPU in recent releases), else a loop over the experts
  (runner.models.grouped_experts). On a CPU the
  loop's per-expert pieces change size every step and fragment glibc's heap (gpt_moe_text's
  ranks held 666 MB above their base after 160 steps with it, 233 MB with the grouped
  product, whose outputs keep one size).
- **Counts.** In a training forward pass (not in a recompute, not in an evaluation) the
  layer adds its tokens per expert, dropped assignments and the balance losses' values to a
  tensor on the device (`stats`); the trainer reads it on log steps only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runner.models.expert_dispatch import by_expert
from runner.models.grouped_experts import expert_mlps, probe_grouped

SCORES = ("softmax", "sigmoid")
STAT_DROPPED, STAT_AUX, STAT_Z = 0, 1, 2  # after the n_experts counts in `stats`


class _Attach(torch.autograd.Function):
    """Return `x` unchanged; in the backward pass give `penalty` the gradient `scale()`
    (a float or a device tensor, read when the backward runs), so that a loss computed
    inside the model joins the gradient wherever the model is cut (pipeline stages,
    checkpointed blocks) without passing through the training loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, penalty: torch.Tensor, scale: Any) -> torch.Tensor:
        ctx.scale = scale
        ctx.penalty_shape = (penalty.dtype, penalty.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        dtype, device = ctx.penalty_shape
        scale = ctx.scale()
        if isinstance(scale, torch.Tensor):
            weight = scale.detach().to(device, dtype).reshape(())
        else:
            weight = torch.full((), float(scale), dtype=dtype, device=device)
        return grad, weight, None


def _in_backward() -> bool:
    """Whether this forward pass is a recompute inside the backward pass (activation
    checkpointing): its routing was counted the first time."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _unit_scale() -> float:
    return 1.0


@dataclass
class RoutingState:
    """What a routing layer shares with the model around it and with the training loop
    (runner.train.step.routing), in one place."""

    layer: int = 0  # which of the model's MoE layers this is (its slot in the step's counts)
    layers: int = 1  # of how many
    # the gradient one sequence's balance losses get, read in the backward pass (the loop's)
    penalty_scale: Callable[[], Any] = _unit_scale
    # [batch, time]: which positions of the pass's batch are real (not padding), for the
    # counts and the balance losses; set by the model before each forward pass
    token_mask: torch.Tensor | None = None
    # the training passes' counts since the last take (see the module text), on the device
    stats: torch.Tensor | None = None

    def add(self, counted: torch.Tensor) -> None:
        self.stats = counted if self.stats is None else self.stats + counted

    def take_stats(self) -> torch.Tensor | None:
        """The counts since the last take (None: no training pass), and start anew."""
        stats, self.stats = self.stats, None
        return stats


class Experts(nn.Module):
    """`n_experts` two-layer GELU MLPs (the gpt's MLP, narrower), stacked."""

    def __init__(self, n_experts: int, n_embd: int, hidden: int):
        super().__init__()
        self.num_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, n_embd, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, n_embd))
        self.reset_parameters()
        probe_grouped()  # before any trace: torch.compile reads a known answer

    def reset_parameters(self, out_std: float = 0.02) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=0.02)
        nn.init.normal_(self.w2, mean=0.0, std=out_std)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Each token of `hidden` [tokens, n_embd] through its experts `top_k_index`
        [tokens, k], weighted by `top_k_weights` [tokens, k] (transformers' contract)."""
        sorted_ = by_expert(top_k_index, self.num_experts)
        return sorted_.combine(self.compute(sorted_.tokens(hidden), sorted_.counts), top_k_weights)

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x`: tokens sorted by expert, `counts[e]` of them for expert e (under expert
        parallelism, this rank's experts: their weights' local parts)."""
        return expert_mlps(x, counts, _local(self.w1), _local(self.w2))


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its experts), or the tensor itself."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class MoE(nn.Module):
    def __init__(
        self,
        n_embd: int,
        n_experts: int,
        top_k: int,
        hidden: int,
        *,
        n_shared: int = 0,
        score: str = "softmax",
        normalize_gates: bool | None = None,
        capacity_factor: float | None = None,
        aux_loss_weight: float = 0.0,
        z_loss_weight: float = 0.0,
        bias_update_speed: float = 0.0,
        dropout: float = 0.0,
    ):
        super().__init__()
        _check(n_experts, top_k, score, capacity_factor, n_shared)
        _check_weights(aux_loss_weight, z_loss_weight, bias_update_speed)
        self.n_experts, self.top_k, self.score = n_experts, top_k, score
        self.normalize_gates = top_k > 1 if normalize_gates is None else normalize_gates
        self.capacity_factor = capacity_factor
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.bias_update_speed = bias_update_speed
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = Experts(n_experts, n_embd, hidden)
        self.shared = (
            nn.Sequential(
                nn.Linear(n_embd, n_shared * hidden, bias=False),
                nn.GELU(),
                nn.Linear(n_shared * hidden, n_embd, bias=False),
            )
            if n_shared
            else None
        )
        self.dropout = nn.Dropout(dropout)
        # added to the scores for choosing experts only (bias_update_speed > 0); kept in the
        # state_dict either way, so a run can turn it on or off across a resume
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.state = RoutingState()  # what the model and the training loop share with it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        tokens = x.reshape(-1, width)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(tokens.float(), self.router.weight.float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias.float() if self.bias_update_speed else scores
        chosen = choice.topk(self.top_k, dim=-1).indices  # [tokens, top_k]
        gates = scores.gather(1, chosen)
        if self.normalize_gates:
            gates = gates / gates.sum(-1, keepdim=True)
        kept = self._kept(chosen)
        if kept is not None:
            gates = gates * kept.view_as(gates)
        out = self.experts(tokens, chosen, gates)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = self.dropout(out.view(batch, time, width))
        if self.training and torch.is_grad_enabled():
            out = self._balanced(out, logits, scores, chosen, kept)
        return out

    @property
    def balance_losses(self) -> bool:
        """Whether the layer adds a balance loss (the auxiliary loss, the z-loss)."""
        return bool(self.aux_loss_weight or self.z_loss_weight)

    def _kept(self, chosen: torch.Tensor) -> torch.Tensor | None:
        """With a capacity: which assignments their expert takes (its first `capacity` in
        token order), else None."""
        if self.capacity_factor is None:
            return None
        sorted_ = by_expert(chosen, self.n_experts)
        capacity = math.ceil(self.capacity_factor * chosen.numel() / self.n_experts)
        starts = sorted_.counts.cumsum(0) - sorted_.counts
        place = torch.empty_like(sorted_.order)
        place[sorted_.order] = torch.arange(chosen.numel(), device=chosen.device)
        return (place - starts[chosen.reshape(-1)]) < capacity

    def _balanced(
        self,
        out: torch.Tensor,
        logits: torch.Tensor,
        scores: torch.Tensor,
        chosen: torch.Tensor,
        kept: torch.Tensor | None,
    ) -> torch.Tensor:
        """Count the pass (not a recompute) and attach the balance losses' gradients."""
        experts, (batch, time) = self.n_experts, out.shape[:2]
        real = self._real(batch, time, out.device)  # [batch, time], 1 where not padding
        lengths = real.sum(1).clamp(min=1)  # a sequence's real tokens
        per_pair = real.reshape(-1).repeat_interleave(self.top_k)  # each assignment's
        share = torch.zeros(batch, experts, device=chosen.device)
        share.scatter_add_(1, chosen.view(batch, -1), per_pair.view(batch, -1))
        # 1 for every expert where a sequence spreads evenly
        share = share * experts / (self.top_k * lengths[:, None])
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        mean_score = (probs.view(batch, time, experts) * real[..., None]).sum(1)
        aux = (share * mean_score / lengths[:, None]).sum()  # over the microbatch's sequences
        squares = logits.logsumexp(-1).square().view(batch, time) * real
        z = (squares.sum(1) / lengths).sum()
        if not _in_backward():
            routed = torch.zeros(experts, device=out.device).index_add_(
                0, chosen.reshape(-1), per_pair
            )
            dropped = (per_pair * ~kept).sum() if kept is not None else per_pair.new_zeros(())
            counted = torch.cat(
                [routed, dropped[None], aux.detach()[None], z.detach()[None]]
            )  # fmt: skip
            self.state.add(counted)
        if self.balance_losses:
            penalty = self.aux_loss_weight * aux + self.z_loss_weight * z
            out = _Attach.apply(out, penalty, self.state.penalty_scale)
        return out

    def _real(self, batch: int, time: int, device: torch.device) -> torch.Tensor:
        """1.0 where a position is a real token (the model's `token_mask`, where it is this
        pass's), else 0.0."""
        mask = self.state.token_mask
        if mask is not None and tuple(mask.shape) == (batch, time):
            return mask.to(device, torch.float32)
        return torch.ones(batch, time, device=device)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """After a step, from its global `counts` per expert: raise the bias of the experts
        that got fewer tokens than the mean, lower the others' (DeepSeek-V3)."""
        if self.bias_update_speed:
            step = torch.sign(counts.float().mean() - counts.float()) * self.bias_update_speed
            self.expert_bias.add_(step.to(self.expert_bias))


def _check_weights(aux_loss_weight: float, z_loss_weight: float, bias_update_speed: float) -> None:
    """The balancing weights: 0 (off) or more; a negative one would unbalance the experts."""
    for key, value in (
        ("aux_loss_weight", aux_loss_weight),
        ("z_loss_weight", z_loss_weight),
        ("bias_update_speed", bias_update_speed),
    ):
        if value < 0:
            raise ValueError(
                f"model.{key}={value}: must be 0 (off) or more; below 0 it would push the "
                "tokens onto fewer experts"
            )


def _check(
    n_experts: int, top_k: int, score: str, capacity_factor: float | None, n_shared: int
) -> None:
    """The layer's options, checked where it is built (before any rank starts: the model
    is built on the meta device first)."""
    if n_experts < 1:
        raise ValueError(f"model.n_experts={n_experts}: must be at least 1")
    if not 1 <= top_k <= n_experts:
        raise ValueError(
            f"model.top_k={top_k}: must be between 1 and model.n_experts={n_experts} "
            "(experts chosen per token)"
        )
    if score not in SCORES:
        raise ValueError(f"model.score={score!r}: must be one of {', '.join(SCORES)}")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(
            f"model.capacity_factor={capacity_factor}: must be above 0 (or null: dropless)"
        )
    if n_shared < 0:
        raise ValueError(f"model.n_shared_experts={n_shared}: must be 0 or more")
