"""Images per second of a training input pipeline over an image folder, one process:

    python benchmarks/image_throughput.py plain|runner|runner-pil ROOT WORKERS

`plain`: the script a user writes from torchvision's examples: ImageFolder (Pillow) with
RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize, and a shuffling
DataLoader with WORKERS workers, batches of 64. `runner`: the trainer's path for
data=image_folder (runner.data.vision's dataset, GlobalBatchSampler, build_train_loader:
per-sample seeded augmentation) with its default decoder (torchvision.io, v2 transforms on
uint8 tensors); `runner-pil`: the same with data.decoder=pil. One warm-up epoch, then two
timed epochs. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import torch

BATCH = 64


def plain(root: str, workers: int):
    from torchvision import datasets
    from torchvision import transforms as T

    tf = T.Compose(
        [
            T.RandomResizedCrop(224),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    train = datasets.ImageFolder(f"{root}/train", transform=tf)
    loader = torch.utils.data.DataLoader(
        train, batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=True
    )
    return len(train), lambda epoch: loader


def runner(root: str, workers: int, decoder: str):
    from runner.data.loaders import build_train_loader
    from runner.data.sampler import GlobalBatchSampler
    from runner.data.vision import image_folder

    train = image_folder(root, decoder=decoder).train
    sampler = GlobalBatchSampler(len(train), BATCH, 1, 0, seed=0)
    loader = build_train_loader(train, sampler, num_workers=workers)

    def epoch_of(epoch: int):
        sampler.set_epoch(epoch)
        return loader

    return len(train), epoch_of


def main(implementation: str, root: str, workers: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    n = int(workers)
    if implementation == "plain":
        count, epoch = plain(root, n)
    else:
        count, epoch = runner(root, n, "pil" if implementation == "runner-pil" else "torchvision")
    for _ in epoch(0):  # warm-up: workers started, files in the page cache
        pass
    start = time.perf_counter()
    for e in (1, 2):
        for _ in epoch(e):
            pass
    seconds = time.perf_counter() - start
    print(json.dumps({"images_per_s": 2 * count / seconds}))


if __name__ == "__main__":
    main(*sys.argv[1:])
