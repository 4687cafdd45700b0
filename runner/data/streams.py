"""Iterable (streaming) datasets: no length, no index; each rank reads its own part.

- Splitting: a Hugging Face `datasets.IterableDataset` is split with the library's own
  `split_dataset_by_node` (whole shards per rank when their count divides the world size,
  else every W-th example). A dataset that splits itself by rank (a WebDataset pipeline with
  `nodesplitter=wds.split_by_node`, or one that sets `splits_by_rank = True`) is left as it
  is. Any other iterable is read whole by every rank, which keeps every W-th example.
- Training: `TrainStream` serves `grad_accum` microbatches per step, forever: a pass that
  ends starts the next one (`set_epoch(pass)` where the dataset has it, so a shuffling
  dataset reshuffles). A global batch is always `global_batch_size` samples.
- Resume: the position is the loader's own state (torchdata's StatefulDataLoader: the
  dataset's `state_dict` where it has one, as Hugging Face's has; otherwise it replays the
  pass up to where it was), saved per rank in every checkpoint. So a checkpoint resumes at
  the world size it was written with; the parent refuses another before launch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from runner.data.loaders import pinning


def is_iterable(dataset: Any) -> bool:
    """An iterable-style dataset: a torch IterableDataset, or anything iterable that cannot be
    indexed by position."""
    if isinstance(dataset, IterableDataset):
        return True
    indexable = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    return not indexable and hasattr(dataset, "__iter__")


def _is_hf_iterable(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "n_shards")


def splits_itself(dataset: Any) -> bool:
    """Does `dataset` hand each rank its own part by itself?"""
    if getattr(dataset, "splits_by_rank", False):
        return True
    pipeline = getattr(dataset, "pipeline", None)  # a WebDataset DataPipeline
    if isinstance(pipeline, list) and type(dataset).__module__.startswith("webdataset"):
        return any(getattr(stage, "__name__", "") == "split_by_node" for stage in pipeline)
    return False


def rank_part(dataset: Any, rank: int, world_size: int) -> Any:
    """This rank's part of an iterable dataset (see the module's docstring)."""
    if world_size == 1 or splits_itself(dataset):
        return dataset
    if _is_hf_iterable(dataset):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return EveryNth(dataset, rank, world_size)


def first_examples(dataset: Any, count: int | None) -> Any:
    """The first `count` examples of a stream (None: all of it), before it is split between
    ranks, so an evaluation reads the same examples at any world size. A dataset that splits
    itself by rank cannot be cut before the split: it is left whole (its evaluation reads
    as many batches of each rank's part as the count makes global batches)."""
    if count is None or splits_itself(dataset):
        return dataset
    if _is_hf_iterable(dataset):
        return dataset.take(count)
    return FirstExamples(dataset, count)


class FirstExamples(IterableDataset):
    """The first `count` examples of `dataset`."""

    def __init__(self, dataset: Any, count: int):
        self.dataset, self.count = dataset, count

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        for i, example in enumerate(self.dataset):
            if i >= self.count:
                return
            yield example


class EveryNth(IterableDataset):
    """Every `world_size`-th example of `dataset`, starting at `rank`; split again between a
    loader's workers, so each example is served once per pass across ranks and workers."""

    def __init__(self, dataset: Any, rank: int, world_size: int):
        self.dataset, self.rank, self.world_size = dataset, rank, world_size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        step = self.world_size * workers
        mine = self.rank * workers + worker_id
        for i, example in enumerate(self.dataset):
            if i % step == mine:
                yield example


class TrainStream:
    """This rank's training microbatches from an iterable dataset, as (batch, real) pairs.

    It stands where the map-style data's sampler and loader stand in the training loop:
    `grad_accum`, `global_count` (always a full global batch), `set_epoch` (nothing to do:
    the position is the loader's) and `steps_per_epoch` (the run is one long pass over the
    stream; `passes` counts the dataset's own passes)."""

    def __init__(
        self,
        dataset: Any,
        micro_batch_size: int,
        grad_accum: int,
        global_batch_size: int,
        total_steps: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seed: int = 0,
    ):
        from torchdata.stateful_dataloader import StatefulDataLoader

        # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.14: nothing to act on
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        self.dataset = dataset
        self.grad_accum = grad_accum
        self.global_batch_size = global_batch_size
        self.steps_per_epoch = total_steps
        self.passes = 0
        collate, pin_memory = pinning(collate_fn or default_collate, pin_memory, num_workers)
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=micro_batch_size,
            drop_last=True,  # every microbatch full: a global batch is global_batch_size
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(seed),
        )

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The loop's epoch is the whole run; the position is restored by load_state_dict."""

    def global_count(self, step_in_epoch: int) -> int:
        return self.global_batch_size

    def _begin_pass(self) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.passes)

    def __iter__(self) -> Iterator[tuple[Any, bool]]:
        restored, self._restored = self._restored, False
        while True:
            if not restored:  # a restored pass was begun by load_state_dict
                self._begin_pass()
            served = False
            for batch in self.loader:
                served = True
                yield batch, True
            if not served and not restored:  # a restored pass may have been at its end
                raise ValueError(
                    f"the training stream gave this rank no batch of {self.loader.batch_size} "
                    "samples in a whole pass: its part holds fewer samples than a microbatch"
                )
            restored = False
            self.passes += 1

    _restored = False

    def state_dict(self) -> dict[str, Any]:
        return {"passes": self.passes, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.passes = state["passes"]
        self._begin_pass()
        self.loader.load_state_dict(state["loader"])
        self._restored = True


def eval_stream(
    dataset: Any,
    batch_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    limit_batches: int | None = None,
) -> Callable[[], Iterator[Any]]:
    """A fresh pass over this rank's validation part, at most `limit_batches` batches (a
    dataset that splits itself, which `first_examples` cannot cut)."""
    from torch.utils.data import DataLoader

    collate, pin_memory = pinning(collate_fn or default_collate, pin_memory, num_workers)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(0),  # not the model's stream (loaders.py)
    )

    def batches() -> Iterator[Any]:
        for i, batch in enumerate(loader):
            if limit_batches is not None and i >= limit_batches:
                return
            yield batch

    return batches
