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
