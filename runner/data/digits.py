"""The 8x8 digits: real data that ships with runner, no download, no scikit-learn.

digits.csv.gz (57 KB) is scikit-learn's copy of the UCI hand-written digits test set, kept
byte for byte beside this module under scikit-learn's BSD-3 license (DIGITS_LICENSE.txt);
tests/test_data.py checks it against sklearn's load_digits.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from runner.data.splits import Datasets
from runner.data.tensors import TensorData

DIGITS_FILE = Path(__file__).with_name("digits.csv.gz")


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images N x 8 x 8 with values 0..16, labels N) in the file's order, as sklearn gives them."""
    with gzip.open(DIGITS_FILE, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> Datasets:
    """1797 images of 1x8x8, 10 classes; a fixed split (split_seed) holds out val_fraction."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: must be between 0 and 1")
    pixels, targets = read_digits()
    images = torch.from_numpy(pixels.astype(np.float32) / 16.0).unsqueeze(1)  # N x 1 x 8 x 8
    images = (images - 0.5) / 0.5
    labels = torch.from_numpy(targets)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(round(len(labels) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return Datasets(
        train=TensorData(images[train], labels[train]),
        val=TensorData(images[val], labels[val]),
        info={"input_shape": (1, 8, 8), "num_classes": 10},
    )
