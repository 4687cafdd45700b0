"""Datasets, the sampler that cuts them into global batches and microbatches, and loaders.

`Datasets` (runner.data.types) is what a data component returns; it imports no torch.
"""

from runner.data.types import Datasets

__all__ = ["Datasets"]
