"""Noisy sine waves: 16 samples of a*sin(x + phase); the targets are (a, phase)."""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset


def _waves(count: int, points: int, noise: float, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    amplitude = torch.rand(count, 1, generator=gen) * 2 + 0.5
    phase = torch.rand(count, 1, generator=gen) * math.pi
    x = torch.linspace(0, 2 * math.pi, points)
    signal = amplitude * torch.sin(x + phase) + noise * torch.randn(count, points, generator=gen)
    return TensorDataset(signal, torch.cat([amplitude, phase], dim=1))


def sine_waves(
    num_train: int = 4096, num_val: int = 512, points: int = 16, noise: float = 0.1
) -> dict:
    """runner's data contract: train and val datasets, plus what the model needs to know."""
    return {
        "train": _waves(num_train, points, noise, seed=1),
        "val": _waves(num_val, points, noise, seed=2),
        "in_features": points,  # reaches WaveRegressor(in_features=...) by name
        "out_features": 2,
    }
