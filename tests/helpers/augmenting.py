"""A data component that augments at random in `__getitem__`, drawing from torch, numpy and
random alike, so restarts, resumes, DataLoader workers and world sizes are tested with
augmentation (tests/test_augmentation.py)."""

from __future__ import annotations

import random

import numpy as np
import torch

from runner.data.digits import digits
from runner.data.splits import Datasets


class Noisy(torch.utils.data.Dataset):
    def __init__(self, base: torch.utils.data.Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.base[index]
        image = image + 0.3 * torch.randn_like(image)
        if random.random() < 0.5:
            image = image.flip(-1)
        return image * float(np.random.uniform(0.8, 1.2)), label


def noisy_digits() -> Datasets:
    data = digits()
    return Datasets(train=Noisy(data.train), val=data.val, info=data.info)


def dropout_mlp(
    input_shape: tuple[int, ...], num_classes: int, hidden_sizes: tuple[int, ...] = (128, 64)
) -> torch.nn.Module:
    """runner's mlp with dropout after each hidden layer: each training step draws from the
    rank's own torch stream, which a restart has to carry on exactly."""
    from runner.models.builders import mlp

    layers = []
    for layer in mlp(input_shape, num_classes, hidden_sizes):
        layers.append(layer)
        if isinstance(layer, torch.nn.ReLU):
            layers.append(torch.nn.Dropout(0.2))
    return torch.nn.Sequential(*layers)
