"""Datasets, the sampler that cuts them into global batches and microbatches, and loaders.

Import the submodules directly: `runner.data.shapes` is used by the parent, which
must not import torch.
"""
