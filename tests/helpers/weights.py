"""Comparing the weights two runs saved (model.pt): bit for bit, or their largest relative
difference."""

from __future__ import annotations

from pathlib import Path

import torch


def same_weights(a: Path, b: Path) -> bool:
    x = torch.load(a / "model.pt", weights_only=True)
    y = torch.load(b / "model.pt", weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def max_relative_difference(a: Path, b: Path) -> float:
    x = torch.load(a / "model.pt", weights_only=True)
    y = torch.load(b / "model.pt", weights_only=True)
    return max(((x[k] - y[k]).norm() / y[k].norm()).item() for k in y)
