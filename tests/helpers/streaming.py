"""Iterable data components for tests/test_streaming.py: scikit-learn's digits written as
WebDataset tar shards (the test writes them), and a user's own IterableDataset."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import torch

from runner.data.digits import read_digits
from runner.data.splits import Datasets

INFO = {"input_shape": (1, 8, 8), "num_classes": 10}


def _images() -> tuple[np.ndarray, np.ndarray]:
    pixels, labels = read_digits()
    return ((pixels / 16.0 - 0.5) / 0.5).astype(np.float32)[:, None], labels


def write_shards(root: Path, train_shards: int = 4, val_shards: int = 3) -> None:
    """Digits as tar shards: train-00000.tar, ... and val-00000.tar, ... (npy image, cls)."""
    images, labels = _images()
    n_val = 300
    root.mkdir(parents=True, exist_ok=True)
    for split, start, stop, count in (
        ("val", 0, n_val, val_shards),
        ("train", n_val, len(labels), train_shards),
    ):
        for shard, part in enumerate(np.array_split(np.arange(start, stop), count)):
            with tarfile.open(root / f"{split}-{shard:05d}.tar", "w") as tar:
                for i in part:
                    buffer = io.BytesIO()
                    np.save(buffer, images[i])
                    for suffix, payload in (("npy", buffer.getvalue()), ("cls", b"%d" % labels[i])):
                        member = tarfile.TarInfo(f"{i:06d}.{suffix}")
                        member.size = len(payload)
                        tar.addfile(member, io.BytesIO(payload))


def _sample(pair: tuple[np.ndarray, int]) -> tuple[torch.Tensor, torch.Tensor]:
    image, label = pair
    return torch.from_numpy(np.asarray(image)), torch.tensor(int(label))


def webdataset_digits(root: str) -> Datasets:
    """The shards through WebDataset, each rank reading its own (split_by_node)."""
    import webdataset as wds

    def shards(split: str) -> list[str]:
        return sorted(str(p) for p in Path(root).glob(f"{split}-*.tar"))

    def pipeline(split: str) -> wds.WebDataset:
        return (
            wds.WebDataset(
                shards(split),
                nodesplitter=wds.split_by_node,
                shardshuffle=False,
                empty_check=False,  # a worker may get no shard of a split
            )
            .decode()
            .to_tuple("npy", "cls")
            .map(_sample)
        )

    return Datasets(train=pipeline("train"), val=pipeline("val"), info=INFO)


class DigitStream(torch.utils.data.IterableDataset):
    """A user's own stream: the digits in order, no length, no state, no splitting."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop

    def __iter__(self):
        images, labels = _images()
        for i in range(self.start, self.stop):
            yield torch.from_numpy(images[i]), torch.tensor(int(labels[i]))


def digit_stream() -> Datasets:
    return Datasets(train=DigitStream(300, 1797), val=DigitStream(0, 300), info=INFO)
