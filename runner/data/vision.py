"""File-backed image datasets through torchvision's loaders. Never downloads."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from runner.data.splits import Datasets

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


DECODERS = ("torchvision", "pil")


def read_rgb(path: str):  # -> torch.Tensor, uint8 3 x H x W
    """An image file as a uint8 RGB tensor: torchvision.io's decoders (libjpeg-turbo, libpng,
    libwebp); a file they cannot read goes through Pillow."""
    import torch
    from torchvision.io import ImageReadMode, decode_image, read_file

    try:
        return decode_image(read_file(path), mode=ImageReadMode.RGB)
    except RuntimeError:
        from PIL import Image

        with Image.open(path) as image:
            pixels = image.convert("RGB")
            return torch.from_numpy(np.asarray(pixels).copy()).permute(2, 0, 1)


def _tensor_transforms(size: int, augment: bool) -> tuple:
    """Transforms on uint8 tensors (torchvision.transforms.v2): crop and resize before the
    conversion to float, the way round that reads and writes the fewest bytes."""
    import torch
    from torchvision.transforms import v2

    normalize = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    evaluate = [v2.Resize(round(size * 256 / 224), antialias=True), v2.CenterCrop(size)]
    train = [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
    return v2.Compose((train if augment else evaluate) + normalize), v2.Compose(
        evaluate + normalize
    )


def _pil_transforms(size: int, augment: bool) -> tuple:
    """Transforms on PIL images (torchvision.transforms), as torchvision's examples have them."""
    from torchvision import transforms as T

    normalize = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    evaluate = [T.Resize(round(size * 256 / 224)), T.CenterCrop(size)]
    train = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
    return T.Compose((train if augment else evaluate) + normalize), T.Compose(evaluate + normalize)


def image_folder(
    root: str, image_size: int = 224, augment: bool = True, decoder: str = "torchvision"
) -> Datasets:
    """ImageNet-style folders: root/train/<class>/* and root/val/<class>/*.

    `decoder`: torchvision (default: torchvision.io decodes to uint8 tensors and the v2
    transforms work on them; faster, see benchmarks/results/image_folder.md) or pil
    (Pillow and the classic transforms, as a plain torchvision script has them)."""
    from torchvision import datasets

    if decoder not in DECODERS:
        raise ValueError(f"data.decoder={decoder!r}: valid: {', '.join(DECODERS)}")
    if decoder == "torchvision":
        (train_tf, val_tf), loader = _tensor_transforms(image_size, augment), read_rgb
    else:
        (train_tf, val_tf), loader = (
            _pil_transforms(image_size, augment),
            datasets.folder.default_loader,
        )
    folder = Path(root)
    train = datasets.ImageFolder(str(folder / "train"), transform=train_tf, loader=loader)
    val = datasets.ImageFolder(str(folder / "val"), transform=val_tf, loader=loader)
    info = {"input_shape": (3, image_size, image_size), "num_classes": len(train.classes)}
    return Datasets(train=train, val=val, info=info)


def cifar10(root: str, augment: bool = True) -> Datasets:
    """CIFAR-10's python-pickle files under root/cifar-10-batches-py."""
    from torchvision import datasets
    from torchvision import transforms as T

    class LocalCIFAR10(datasets.CIFAR10):
        """torchvision's loader without its md5 check of the official files: the layout is
        what matters (the parent checked it), and nothing is ever downloaded."""

        def _check_integrity(self) -> bool:
            folder = Path(self.root) / self.base_folder
            return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)

        def _load_meta(self) -> None:
            with open(Path(self.root) / self.base_folder / self.meta["filename"], "rb") as f:
                self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    normalize = [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    augment = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if augment else []
    root = str(root)
    train = LocalCIFAR10(root, train=True, transform=T.Compose(augment + normalize))
    val = LocalCIFAR10(root, train=False, transform=T.Compose(normalize))
    return Datasets(train=train, val=val, info={"input_shape": (3, 32, 32), "num_classes": 10})
