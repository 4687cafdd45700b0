"""Image classifiers as a model family: torchvision's models (runner's resnet18 and resnet50
build them: runner.models.builders) and timm's. Nothing of their own to split by tensor,
pipeline, context or experts (the generic family's answers); their blocks are found by
looking. Ranks that build one import torchvision's models, which the fork server may
import once for all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.models.families.family import Family

if TYPE_CHECKING:
    from torch import nn

BUILDERS = ("runner.models.builders.resnet",)  # runner's own, built by torchvision
PACKAGES = ("torchvision.models", "timm")


class VisionFamily(Family):
    name = "vision"
    order = 40

    def claims(self, model: nn.Module) -> bool:
        return type(model).__module__.startswith(PACKAGES)

    def builds(self, target: str) -> bool:
        return target.startswith(BUILDERS + tuple(f"{p}." for p in PACKAGES))

    def preloads(self, target: str, device: str) -> list[str]:
        return ["torchvision.models"] if target.startswith(BUILDERS) else []


FAMILY = VisionFamily()
