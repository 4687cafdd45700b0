"""What a data spec feeds the model (input shape, number of classes), without loading it.

The parent uses this to check a resume checkpoint against the configured model
before any rank starts; the loaders report the same values (tested).
"""

from __future__ import annotations

from pathlib import Path

from runner.spec.schema import Cifar10Spec, DataSpec, DigitsSpec, ImageFolderSpec, SyntheticSpec


def data_shape(spec: DataSpec) -> tuple[tuple[int, ...], int]:
    """(input_shape, num_classes) of the samples `spec` produces."""
    if isinstance(spec, DigitsSpec):
        return (1, 8, 8), 10
    if isinstance(spec, SyntheticSpec):
        return (3, spec.image_size, spec.image_size), spec.num_classes
    if isinstance(spec, ImageFolderSpec):
        train = Path(spec.root or "") / "train"
        classes = sum(1 for p in train.iterdir() if p.is_dir()) if train.is_dir() else 0
        return (3, spec.image_size, spec.image_size), classes
    if isinstance(spec, Cifar10Spec):
        return (3, 32, 32), 10
    raise ValueError(f"data.name={spec.name!r} has no shape")
