"""Synthetic images with a learnable signal: each class owns a fixed random template."""

from __future__ import annotations

import torch

from runner.data.tensors import TensorData
from runner.data.types import Datasets
from runner.spec.schema import SyntheticSpec

_DATA_SEED = 20240607  # the data never depends on the run's seed


def _split(spec: SyntheticSpec, templates: torch.Tensor, count: int, seed: int) -> TensorData:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, spec.num_classes, (count,), generator=gen)
    noise = torch.randn((count, *templates.shape[1:]), generator=gen)
    return TensorData(noise + spec.signal * templates[labels], labels)


def make_synthetic(spec: SyntheticSpec) -> Datasets:
    shape = (3, spec.image_size, spec.image_size)
    gen = torch.Generator().manual_seed(_DATA_SEED)
    # Smooth templates (upsampled low-resolution noise) so convolutions can pick them up.
    coarse = torch.randn((spec.num_classes, 3, 4, 4), generator=gen)
    templates = torch.nn.functional.interpolate(
        coarse, size=shape[1:], mode="bilinear", align_corners=False
    )
    templates = templates / templates.std()
    return Datasets(
        train=_split(spec, templates, spec.num_train, _DATA_SEED + 1),
        val=_split(spec, templates, spec.num_val, _DATA_SEED + 2),
        input_shape=shape,
        num_classes=spec.num_classes,
    )
