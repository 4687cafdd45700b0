"""Datasets and the loaders that cut them into global batches and microbatches."""

from runner.data.datasets import Datasets, build_datasets
from runner.data.loaders import build_eval_loader, build_train_loader
from runner.data.sampler import GlobalBatchSampler

__all__ = [
    "Datasets",
    "GlobalBatchSampler",
    "build_datasets",
    "build_eval_loader",
    "build_train_loader",
]
