"""An in-memory dataset that serves whole batches with one indexing op."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TensorData(torch.utils.data.Dataset):
    """Inputs and labels held as two tensors; `batch(indices)` gathers many at once."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor):
        if len(inputs) != len(labels):
            raise ValueError(f"{len(inputs)} inputs but {len(labels)} labels")
        self.inputs = inputs
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.inputs[index], self.labels[index]
