"""runner's built-in models, as components (`model._target_`), and `build_model`.

Every builder takes what the data reports (`input_shape`, `num_classes`) by name, so a
config names only the model's own choices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from runner.components import instantiate
from runner.spec.schema import ModelSpec


def build_model(spec: ModelSpec, provided: Mapping[str, Any] | None = None) -> nn.Module:
    """Instantiate the `model` component; `provided` is what the data reports."""
    module = instantiate(spec.node, provided)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"model._target_={spec.target} returned {type(module).__name__}, not a torch.nn.Module"
        )
    return module


def mlp(
    input_shape: Sequence[int], num_classes: int, hidden_sizes: Sequence[int] = (128, 64)
) -> nn.Module:
    """Flattens any input; no dropout and no batch norm, so every split trains alike."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for hidden in hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def resnet18(
    num_classes: int,
    input_shape: Sequence[int] = (3, 224, 224),
    small_input_stem: bool = False,
    zero_init_residual: bool = False,
) -> nn.Module:
    """torchvision's ResNet-18, from scratch (weights are never downloaded)."""
    return _resnet("resnet18", num_classes, input_shape, small_input_stem, zero_init_residual)


def resnet50(
    num_classes: int,
    input_shape: Sequence[int] = (3, 224, 224),
    small_input_stem: bool = False,
    zero_init_residual: bool = False,
) -> nn.Module:
    """torchvision's ResNet-50, from scratch (weights are never downloaded)."""
    return _resnet("resnet50", num_classes, input_shape, small_input_stem, zero_init_residual)


def _resnet(
    arch: str,
    num_classes: int,
    input_shape: Sequence[int],
    small_input_stem: bool,
    zero_init_residual: bool,
) -> nn.Module:
    from torchvision import models

    factory = {"resnet18": models.resnet18, "resnet50": models.resnet50}[arch]
    model = factory(weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual)
    channels = input_shape[0]
    if small_input_stem:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
