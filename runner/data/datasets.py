"""Build the train and validation datasets a data spec names (imports only what it needs)."""

from __future__ import annotations

from runner.data.types import Datasets
from runner.spec.schema import DataSpec


def build_datasets(spec: DataSpec) -> Datasets:
    if spec.name == "digits":
        from runner.data.digits import load_digits

        return load_digits(spec)
    if spec.name == "synthetic":
        from runner.data.synthetic import make_synthetic

        return make_synthetic(spec)
    if spec.name == "image_folder":
        from runner.data.vision import load_image_folder

        return load_image_folder(spec)
    if spec.name == "cifar10":
        from runner.data.vision import load_cifar10

        return load_cifar10(spec)
    raise ValueError(f"data.name={spec.name!r} has no builder")
