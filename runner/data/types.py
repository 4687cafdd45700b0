"""`Datasets`: what every dataset builder returns (its own module so builders and the
dispatch in runner.data.datasets never import each other)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Datasets:
    """The train and validation datasets of a run, and what the model needs to know of them."""

    train: Any
    val: Any
    input_shape: tuple[int, ...]
    num_classes: int
