"""The model: any torch.nn.Module. runner fills in in_features and out_features from the data."""

from __future__ import annotations

from torch import nn


class WaveRegressor(nn.Module):
    def __init__(self, in_features: int, out_features: int, hidden: int = 64, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, signal):
        return self.net(signal)
