"""Datasets, the sampler that cuts them into global batches and microbatches, and loaders.

`Datasets` (runner.data.splits) is what a data component returns; it imports no torch.
"""

from runner.data.splits import Datasets

__all__ = ["Datasets"]
