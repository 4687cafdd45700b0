"""Image datasets on disk in the layouts runner reads (ImageFolder, CIFAR-10's pickles),
made by the tests."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from PIL import Image


def make_image_folder(root: Path, classes: int = 3, per_class: int = 4, size: int = 20) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def make_cifar10(root: Path, per_batch: int = 8) -> Path:
    """The python-pickle layout torchvision's CIFAR10 reads (tiny batches)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 255, (per_batch, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, per_batch).tolist(),
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    return root
