"""scikit-learn's bundled 8x8 digits: real data that ships with the package, no download."""

from __future__ import annotations

import numpy as np
import torch

from runner.data.datasets import Datasets
from runner.data.tensors import TensorData
from runner.spec.schema import DigitsSpec


def load_digits(spec: DigitsSpec) -> Datasets:
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)  # N x 1 x 8 x 8
    images = (images - 0.5) / 0.5
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(spec.split_seed))
    n_val = int(round(len(labels) * spec.val_fraction))
    val, train = order[:n_val], order[n_val:]
    return Datasets(
        train=TensorData(images[train], labels[train]),
        val=TensorData(images[val], labels[val]),
        input_shape=(1, 8, 8),
        num_classes=10,
    )
