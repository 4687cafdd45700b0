"""File-backed image datasets through torchvision's loaders. Never downloads."""

from __future__ import annotations

import pickle
from pathlib import Path

from runner.data.types import Datasets
from runner.spec.schema import Cifar10Spec, ImageFolderSpec

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def load_image_folder(spec: ImageFolderSpec) -> Datasets:
    from torchvision import datasets
    from torchvision import transforms as T

    size = spec.image_size
    normalize = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if spec.augment:
        train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), *normalize])
    else:
        train_tf = T.Compose([T.Resize(round(size * 256 / 224)), T.CenterCrop(size), *normalize])
    val_tf = T.Compose([T.Resize(round(size * 256 / 224)), T.CenterCrop(size), *normalize])
    root = Path(spec.root or "")
    train = datasets.ImageFolder(str(root / "train"), transform=train_tf)
    val = datasets.ImageFolder(str(root / "val"), transform=val_tf)
    return Datasets(
        train=train, val=val, input_shape=(3, size, size), num_classes=len(train.classes)
    )


def load_cifar10(spec: Cifar10Spec) -> Datasets:
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
    augment = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if spec.augment else []
    root = str(spec.root)
    train = LocalCIFAR10(root, train=True, transform=T.Compose(augment + normalize))
    val = LocalCIFAR10(root, train=False, transform=T.Compose(normalize))
    return Datasets(train=train, val=val, input_shape=(3, 32, 32), num_classes=10)
