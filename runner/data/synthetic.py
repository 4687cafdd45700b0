"""Synthetic images with a learnable signal: each class owns a fixed random template."""

from __future__ import annotations

import torch

from runner.data.splits import Datasets
from runner.data.tensors import TensorData

_DATA_SEED = 20240607  # the data never depends on the run's seed


def _split(templates: torch.Tensor, signal: float, count: int, seed: int) -> TensorData:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(templates), (count,), generator=gen)
    noise = torch.randn((count, *templates.shape[1:]), generator=gen)
    return TensorData(noise + signal * templates[labels], labels)


def synthetic(
    num_train: int = 2048,
    num_val: int = 512,
    image_size: int = 32,
    num_classes: int = 10,
    signal: float = 0.5,
) -> Datasets:
    """3 x image_size x image_size images: noise plus a fixed template per class."""
    if min(num_train, num_val) < 1 or image_size < 8 or num_classes < 2 or signal <= 0:
        raise ValueError(
            "synthetic: needs num_train, num_val >= 1, image_size >= 8, num_classes >= 2 "
            "and signal > 0"
        )
    shape = (3, image_size, image_size)
    gen = torch.Generator().manual_seed(_DATA_SEED)
    # Smooth templates (upsampled low-resolution noise) so convolutions can pick them up.
    coarse = torch.randn((num_classes, 3, 4, 4), generator=gen)
    templates = torch.nn.functional.interpolate(
        coarse, size=shape[1:], mode="bilinear", align_corners=False
    )
    templates = templates / templates.std()
    return Datasets(
        train=_split(templates, signal, num_train, _DATA_SEED + 1),
        val=_split(templates, signal, num_val, _DATA_SEED + 2),
        info={"input_shape": shape, "num_classes": num_classes},
    )
