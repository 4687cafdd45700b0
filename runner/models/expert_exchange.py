"""Expert parallelism's token exchange (runner.models.expert_split): a rank's assignments,
sorted by expert, go to the ranks of its group that hold their experts; each rank computes
what arrives, grouped by its own experts; the outputs go back in the order they left.

One all-to-all of the counts, then one of the tokens each way; the backward pass sends the
gradients back the same ways. The split sizes are read on the host (on a GPU, a wait for
the device per layer and pass, as in torchtitan's and Megatron's dropless dispatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class _AllToAll(torch.autograd.Function):
    """Rows of `x` to the ranks of `group`, `sent[r]` rows to rank r in order, `came[r]`
    rows from it; the backward pass sends the gradients back the same way."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, came: list[int], sent: list[int], group: Any
    ) -> torch.Tensor:
        import torch.distributed as dist

        ctx.came, ctx.sent, ctx.group = came, sent, group
        out = x.new_empty((sum(came), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), came, sent, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        import torch.distributed as dist

        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.came, group=ctx.group)
        return back, None, None, None


@torch.compiler.disable  # host-read split sizes, new every pass
def exchange(
    sorted_in: torch.Tensor,
    counts: torch.Tensor,
    group: Any,
    per_rank: int,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The outputs of this rank's assignments `sorted_in` (sorted by expert, `counts[e]` for
    expert e of all of them), computed by the ranks of `group` that hold their experts,
    `per_rank` each in group order: `compute(tokens, counts)` runs a rank's own experts on
    tokens sorted by them."""
    import torch.distributed as dist

    ranks = counts.numel() // per_rank
    arriving = torch.empty_like(counts)  # [source rank, my expert], flattened
    dist.all_to_all_single(arriving, counts, group=group)
    sent = counts.view(ranks, per_rank).sum(1).tolist()
    table = arriving.view(ranks, per_rank).tolist()
    came = [sum(row) for row in table]
    received = _AllToAll.apply(sorted_in, came, sent, group)
    # by source rank, then by expert: regrouped by expert for the computation
    starts = [0]
    for row in table:
        for size in row:
            starts.append(starts[-1] + size)
    pieces = [
        torch.arange(starts[s * per_rank + e], starts[s * per_rank + e] + table[s][e])
        for e in range(per_rank)
        for s in range(ranks)
    ]
    by_expert = torch.cat(pieces).to(received.device)
    per_expert = [sum(table[s][e] for s in range(ranks)) for e in range(per_rank)]
    computed = compute(received[by_expert], torch.tensor(per_expert, device=counts.device))
    back = torch.empty_like(computed)
    back[by_expert] = computed
    return _AllToAll.apply(back, sent, came, group)
