"""Synthetic images with a learnable signal: each class owns a fixed random template."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runner.data.splits import Datasets

_DATA_SEED = 20240607  # the data never depends on the run's seed


HELD_BYTES = 256 * 2**20  # a split up to this size is made once and held in memory


class SyntheticImages(torch.utils.data.Dataset):
    """`count` images of a split, each a function of (seed, index) alone. A split of up to
    HELD_BYTES is made once and held (a batch is one indexing op); a larger one makes each
    image as it is read, the same one every time (at image_size=224, 2,048 images held were
    1.2 GB in every rank)."""

    def __init__(self, templates: torch.Tensor, signal: float, count: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, len(templates), (count,), generator=gen, device="cpu")
        self.templates, self.signal, self.seed = templates, signal, seed
        self.inputs: torch.Tensor | None = None
        if count * templates[0].numel() * 4 <= HELD_BYTES:
            self.inputs = torch.stack([self._made(i) for i in range(count)])

    def __len__(self) -> int:
        return len(self.labels)

    def _made(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed << 32) + int(index))
        noise = torch.randn(self.templates.shape[1:], generator=gen, device="cpu")
        return noise + self.signal * self.templates[self.labels[index]]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self._made(index) if self.inputs is None else self.inputs[index]
        return image, self.labels[index]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        if self.inputs is not None:
            return self.inputs[index], self.labels[index]
        return torch.stack([self._made(i) for i in indices]), self.labels[index]


def synthetic(
    num_train: int = 2048,
    num_val: int = 512,
    image_size: int = 32,
    num_classes: int = 10,
    signal: float = 0.5,
) -> Datasets:
    """3 x image_size x image_size images: noise plus a fixed template per class (on the
    CPU, whatever the default device)."""
    if min(num_train, num_val) < 1 or image_size < 8 or num_classes < 2 or signal <= 0:
        raise ValueError(
            "synthetic: needs num_train, num_val >= 1, image_size >= 8, num_classes >= 2 "
            "and signal > 0"
        )
    shape = (3, image_size, image_size)
    gen = torch.Generator().manual_seed(_DATA_SEED)
    # Smooth templates (upsampled low-resolution noise) so convolutions can pick them up.
    coarse = torch.randn((num_classes, 3, 4, 4), generator=gen, device="cpu")
    templates = torch.nn.functional.interpolate(
        coarse, size=shape[1:], mode="bilinear", align_corners=False
    )
    templates = templates / templates.std()
    return Datasets(
        train=SyntheticImages(templates, signal, num_train, _DATA_SEED + 1),
        val=SyntheticImages(templates, signal, num_val, _DATA_SEED + 2),
        info={"input_shape": shape, "num_classes": num_classes},
    )
