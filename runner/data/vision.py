"""File-backed image datasets through torchvision's loaders. Never downloads."""

from __future__ import annotations

import pickle
from pathlib import Path

from runner.data.types import Datasets

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def image_folder(root: str, image_size: int = 224, augment: bool = True) -> Datasets:
    """ImageNet-style folders: root/train/<class>/* and root/val/<class>/*."""
    from torchvision import datasets
    from torchvision import transforms as T

    size = image_size
    normalize = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if augment:
        train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), *normalize])
    else:
        train_tf = T.Compose([T.Resize(round(size * 256 / 224)), T.CenterCrop(size), *normalize])
    val_tf = T.Compose([T.Resize(round(size * 256 / 224)), T.CenterCrop(size), *normalize])
    train = datasets.ImageFolder(str(Path(root) / "train"), transform=train_tf)
    val = datasets.ImageFolder(str(Path(root) / "val"), transform=val_tf)
    info = {"input_shape": (3, size, size), "num_classes": len(train.classes)}
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
