"""The loss on logits split across a tensor group by vocabulary (loss parallel).

A tensor-parallel head can leave its logits split by class: each rank holds its columns of
[batch, time, vocabulary] (a DTensor sharded on its last dimension), and torch's
`loss_parallel` computes cross-entropy from them with two small all-reduces (the max and
the sum of the exponentials) instead of gathering the whole [batch, time, vocabulary] on
every rank. A loss may run so when it says it does (`splits_classes`: runner's CausalLM,
CrossEntropy without label smoothing); any other loss, and the metrics, get the logits
gathered whole.

torch's context is not re-entrant (leaving an inner one turns it off), so runner enters it
once however deeply it is asked for: a training microbatch's forward and backward run
inside the engine's, and the loss asks again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_depth = 0


@contextlib.contextmanager
def split_loss() -> Iterator[None]:
    """torch's loss_parallel, entered at the outermost call only."""
    global _depth
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        _depth = 1
        try:
            yield
        finally:
            _depth = 0


def split_by_class(logits: Any) -> bool:
    """Whether `logits` are a DTensor split along their last (class) dimension."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        return False
    last = logits.ndim - 1
    return any(p.is_shard() and p.dim % logits.ndim == last for p in logits.placements)


def gathered(logits: Any) -> Any:
    """The logits as one plain tensor on every rank (gathered where they are split)."""
    from torch.distributed.tensor import DTensor

    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def loss_of(loss_fn: Any, logits: Any, targets: Any) -> tuple[Any, Any]:
    """`loss_fn(logits, targets)`, on split logits where the loss runs on them (the summed
    loss then comes back a plain tensor, the same on every rank of the group; its backward
    must run inside split_loss()), else on the logits gathered whole."""
    if not split_by_class(logits):
        return loss_fn(logits, targets)
    if not getattr(loss_fn, "splits_classes", False):
        return loss_fn(gathered(logits), targets)
    with split_loss():
        loss, count = loss_fn(logits, targets)
    return loss.to_local(), count
