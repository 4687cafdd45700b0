"""Built-in losses. A loss is any callable `loss(outputs, targets) -> (summed loss, items)`.

The sum is over the items of one microbatch (samples for classification, non-ignored
tokens for a language model) and `items` says how many it covered. runner divides every
microbatch's sum by the items of the whole global batch, counted across every microbatch
and every rank, so any split of the batch trains the same model (not a mean of
per-microbatch means, the gradient-accumulation bug Hugging Face fixed in 2024).

A loss whose items are not samples also has `count(targets)`: the items a microbatch
holds, read from its targets before any forward pass, so the global count is known
before the first backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CrossEntropy:
    """Classification: one item per sample. `outputs` are logits [N, C], targets [N]."""

    def __init__(self, label_smoothing: float = 0.0):
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 1)")
        self.label_smoothing = label_smoothing
        # cross-entropy on logits split by class across a tensor group (loss parallel):
        # torch's supports no label smoothing
        self.splits_classes = label_smoothing == 0.0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        loss = F.cross_entropy(
            outputs.float(), targets, reduction="sum", label_smoothing=self.label_smoothing
        )
        return loss, targets.shape[0]


class CausalLM:
    """Next-token prediction: logits [N, T, V] at position t predict targets[:, t + 1].

    Targets equal to `ignore_index` (padding, prompt tokens) are no items: they add
    nothing to the loss and are not counted.
    """

    splits_classes = True  # runs on logits split by vocabulary (runner.engines.loss_parallel)

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index

    def __call__(
        self, outputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = outputs[:, :-1].float()
        shifted = targets[:, 1:]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            shifted.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return loss, self.count(targets)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets[:, 1:] != self.ignore_index).sum()
