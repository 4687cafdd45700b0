"""Context parallelism (parallelism.context=C), for a model whose family hooks its sequence
(runner's gpt): the sequence split across C ranks that read the same batch, each computing
its own positions of every layer.

Attention is the one operation that mixes positions: each rank gathers the keys and values
of every position from its group (an all-gather whose backward pass sums the gradients back
to their ranks, Llama 3's way; it runs on every device and backend) and attends its own
queries to them under the causal mask of the true positions. Everything else works token
by token.

Causal attention's work grows along the sequence, so a rank with the sequence's last chunk
would do most of it: the sequence is cut into 2C chunks and rank c takes chunks c and
2C-1-c (a head and a tail), which evens the work out. A sequence that 2C does not divide is
padded at the end, where causal attention keeps every real position from seeing it.

The loss sees the rank's logits and, for each of its positions, the token that follows it
in the whole sequence: targets laid out so that a next-token loss (runner's causal_lm,
which pairs logits at t with targets at t + 1) and next-token metrics (perplexity) compute
this rank's share, and count its tokens (`local`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class ContextSplit:
    """The positions this rank computes, and the attention across its group."""

    def __init__(self, group: Any, rank: int, size: int, ignore_index: int = -100):
        self.group, self.rank, self.size, self.ignore_index = group, rank, size, ignore_index
        self.positions: torch.Tensor | None = None  # this rank's, set per forward pass
        self.inverse: torch.Tensor | None = None  # gathered keys back into sequence order
        self.length = 0  # of the padded sequence
        self._masks: dict[tuple[int, int], Any] = {}

    def owned(self, rank: int, length: int, device: Any) -> torch.Tensor:
        """The positions `rank` computes in a sequence of `length` (2C divides it)."""
        chunk = length // (2 * self.size)
        head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        tail_start = (2 * self.size - 1 - rank) * chunk
        return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])

    @property
    def multiple(self) -> int:
        """The padded sequence's length is a multiple of 2C (each rank a head and a tail)."""
        return 2 * self.size

    def take(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The gpt's hook: (this rank's tokens, their positions, no mask): the positions
        attend by the causal mask of the true positions (`attend`)."""
        positions = self.prepare(input_ids.shape[1], input_ids.device)
        return input_ids[:, positions], positions, None

    def output(self, logits: torch.Tensor, time: int) -> torch.Tensor:
        """This rank's positions' logits, as they are (`local` pairs them with targets)."""
        return logits

    def prepare(self, length: int, device: Any) -> torch.Tensor:
        """Before a forward pass over sequences of `length` (padded): this rank's positions."""
        self.length = length
        self.positions = self.owned(self.rank, length, device)
        every = torch.cat([self.owned(r, length, device) for r in range(self.size)])
        self.inverse = torch.argsort(every)  # gathered (rank by rank) -> sequence order
        return self.positions

    def _lower_right(self, queries: int, keys: int) -> Any:
        """torch's lower-right causal bias, made once per shape (every layer and step reuse it)."""
        if (queries, keys) not in self._masks:
            from torch.nn.attention.bias import causal_lower_right

            self._masks[queries, keys] = causal_lower_right(queries, keys)
        return self._masks[queries, keys]

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position's keys and values [batch, heads, positions, size], in sequence
        order."""
        both = torch.stack([k, v])  # one collective for both
        gathered = GatherPositions.apply(both, self.group, self.rank, self.size)
        in_order = gathered[:, :, :, self.inverse]
        return in_order[0], in_order[1]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout: float,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's queries (its head chunk, then its tail chunk) attended to every
        position's keys and values: each chunk sees the sequence up to itself, causally at
        its own end (a lower-right causal mask, which fused attention kernels take without a
        mask tensor)."""
        keys, values = self.gather(k, v)
        chunk = self.length // (2 * self.size)
        ends = ((self.rank + 1) * chunk, (2 * self.size - self.rank) * chunk)
        parts = []
        for queries, end in zip(q.split(chunk, dim=2), ends, strict=True):
            mask = self._lower_right(chunk, end)
            parts.append(
                F.scaled_dot_product_attention(
                    queries, keys[:, :, :end], values[:, :, :end], attn_mask=mask, dropout_p=dropout
                )
            )
        return torch.cat(parts, dim=2)

    def local(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(logits, targets) as a next-token loss reads them for this rank's positions: the
        logits with one unused position appended, the targets with one unused before, so
        that logits at i meet the token after position i of the whole sequence."""
        time = targets.shape[1]
        pad = self.length - time
        if pad:
            targets = F.pad(targets, (0, pad), value=self.ignore_index)
        following = F.pad(targets[:, 1:], (0, 1), value=self.ignore_index)
        mine = following[:, self.positions]
        unused = torch.full_like(mine[:, :1], self.ignore_index)
        laid_out = torch.cat([unused, mine], dim=1)
        chunk = self.length // (2 * self.size)
        starts = (self.rank * chunk, (2 * self.size - 1 - self.rank) * chunk)
        within = sum(min(chunk, max(0, time - start)) for start in starts)  # not the padding
        laid_out.runner_tokens = targets.shape[0] * within  # counted on the host
        return F.pad(logits, (0, 0, 0, 1)), laid_out

    def tokens(self, targets: torch.Tensor) -> int:
        """This rank's tokens of the batch's sequences, as `local` laid them out (the padding
        that 2C asks for left out)."""
        return getattr(targets, "runner_tokens", targets.numel() - targets.shape[0])


class GatherPositions(torch.autograd.Function):
    """Every rank's [2, batch, heads, positions, size] side by side along the positions; its
    backward pass sums each rank's part of the gradient over the group back to that rank: a
    reduce-scatter on NCCL, an all-reduce elsewhere (gloo has no reduce-scatter; torch's own
    autograd all_gather emulates one with ranks of the whole world, wrong in a subgroup)."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.size = group, rank, size
        parts = [torch.empty_like(part) for _ in range(size)]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=3)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        import torch.distributed as dist

        rows = grad.movedim(3, 0).contiguous()  # the positions first: one block per rank
        if dist.get_backend(ctx.group) == "nccl":
            mine = rows.new_empty((rows.shape[0] // ctx.size, *rows.shape[1:]))
            dist.reduce_scatter_tensor(mine, rows, group=ctx.group)
        else:
            dist.all_reduce(rows, group=ctx.group)
            mine = rows.chunk(ctx.size)[ctx.rank]
        return mine.movedim(0, 3), None, None, None


def apply_context(
    model: nn.Module, group: Any, rank: int, size: int, ignore_index: int
) -> ContextSplit:
    """Split the model's sequence across the context group (see the module text): its
    family hands the split to its forward pass in place of the whole sequence. Returns it
    (how the loss pairs this rank's logits with targets)."""
    from runner.models.families import family_of

    split = ContextSplit(group, rank, size, ignore_index)
    family_of(model).hook_sequence(model, split)
    return split


def context_problems(model: nn.Module, context: int) -> list[str]:
    """What the context split needs of the model: a family with a sequence hook (runner's
    gpt's)."""
    from runner.models.families import family_of

    return family_of(model).context_problems(model, context)


def offered(model: nn.Module) -> bool:
    """Whether `model` can have its sequence split (runner.spec.mesh.DIMENSIONS)."""
    return not context_problems(model, 2)


def spec_problems(model: nn.Module, spec: Any) -> list[str]:
    """Context parallelism's checks of a run's model (runner.spec.mesh.DIMENSIONS)."""
    return context_problems(model, spec.grid.context) if spec.grid.context > 1 else []
