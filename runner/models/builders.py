"""Build the model a spec names, shaped for the data (input channels, classes)."""

from __future__ import annotations

import math

from torch import nn

from runner.spec.schema import MLPSpec, ModelSpec, ResNetSpec


def build_model(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if isinstance(spec, MLPSpec):
        return _mlp(spec, input_shape, num_classes)
    if isinstance(spec, ResNetSpec):
        return _resnet(spec, input_shape, num_classes)
    raise ValueError(f"model.name={spec.name!r} has no builder")


def _mlp(spec: MLPSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for hidden in spec.hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _resnet(spec: ResNetSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    from torchvision import models

    factory = {"resnet18": models.resnet18, "resnet50": models.resnet50}[spec.name]
    model = factory(
        weights=None, num_classes=num_classes, zero_init_residual=spec.zero_init_residual
    )
    channels = input_shape[0]
    if spec.small_input_stem:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
