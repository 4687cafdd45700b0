"""Input that never waits, on a GPU (`input_prefetch`): the loader's next microbatches are
drawn while the current step is queued, and copied to the device on a stream of their own,
so the copy runs beside the step's kernels instead of before the next step's.

The trainer keeps drawing host batches (their items are counted on the host, before they
move); each item comes with its batch's device copy as a field of its own (`DeviceCopy`,
after the loader's fields), which the forward pass reads: the pass's stream then waits for
the copy (an event, not the host), and the copy is marked as used on that stream for the
caching allocator. A batch cut anew (grad_accum=auto) is a new item without a copy, and a
pipeline's schedule takes host batches: both move as they would without the feed.

Off on the CPU, and for an iterable training set: a checkpoint keeps such a stream's
position, which drawing ahead would move past the batches not yet trained on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from runner.data.tensor_tree import tensors_of
from runner.train.step.batch_parts import to_device


def wanted(enabled: bool, device: str, streaming: bool) -> bool:
    """Whether a run's batches go through a DeviceFeed."""
    return enabled and torch.device(device).type == "cuda" and not streaming


@dataclass(frozen=True)
class DeviceCopy:
    """A batch's copy on the device, made on the feed's stream; `done` once it is made."""

    moved: Any
    done: Any  # a torch.cuda.Event recorded on the feed's stream

    def ready(self, device: torch.device) -> Any:
        """The copy, ready for `device`'s current stream to read."""
        stream = torch.cuda.current_stream(device)
        stream.wait_event(self.done)
        for tensor in tensors_of(self.moved):
            tensor.record_stream(stream)
        return self.moved


def copy_of(item: tuple[Any, ...]) -> DeviceCopy | None:
    """The device copy a feed gave `item` (a loader's item, its batch first), if any."""
    return next((part for part in item[1:] if isinstance(part, DeviceCopy)), None)


class DeviceFeed:
    """The loader's items, `ahead` of them drawn and copying to `device` before they are
    asked for; each item comes out with its batch's DeviceCopy after the loader's fields."""

    def __init__(
        self, items: Iterator[Any], device: str, channels_last: bool = False, ahead: int = 1
    ):
        self.items, self.ahead = items, max(1, ahead)
        self.device, self.channels_last = torch.device(device), channels_last
        self.stream = torch.cuda.Stream(self.device)
        self.queue: deque[Any] = deque()
        self.ended = False

    def __iter__(self) -> DeviceFeed:
        return self

    def __next__(self) -> Any:
        self._fill()
        if not self.queue:
            raise StopIteration
        item = self.queue.popleft()
        self._fill()  # the next ones start copying now, behind this one's step
        return item

    def _fill(self) -> None:
        while not self.ended and len(self.queue) <= self.ahead:
            try:
                item = next(self.items)
            except StopIteration:
                self.ended = True
                return
            self.queue.append((*item, self._copy(item[0])))

    def _copy(self, batch: Any) -> DeviceCopy:
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.device, self.channels_last)
            done = torch.cuda.Event()
            done.record(self.stream)
        return DeviceCopy(moved, done)
