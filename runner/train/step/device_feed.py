"""Input that never waits, on a GPU (`input_prefetch`): the loader's next microbatches are
drawn while the current step is queued, and copied to the device on a stream of their own,
so the copy runs beside the step's kernels instead of before the next step's.

The trainer keeps drawing host batches (their items are counted on the host, before they
move); a batch's device copy waits here, under the batch, until its forward pass asks for
it: the pass's stream then waits for the copy (an event, not the host), and the copy is
marked as used on that stream for the caching allocator. A batch the pass never asks for
(cut anew by grad_accum=auto, or run by a pipeline's schedule) moves as it would without
the feed, and its early copy is dropped.

Off on the CPU, and for an iterable training set: a checkpoint keeps such a stream's
position, which drawing ahead would move past the batches not yet trained on.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any

import torch

from runner.data.tensor_tree import tensors_of
from runner.train.step.batch_parts import to_device


def wanted(enabled: bool, device: str, streaming: bool) -> bool:
    """Whether a run's batches go through a DeviceFeed."""
    return enabled and torch.device(device).type == "cuda" and not streaming


class DeviceFeed:
    """The loader's items, `ahead` of them drawn and copying to `device` before they are
    asked for. An item is (batch, ...), as the training loader gives it."""

    def __init__(
        self, items: Iterator[Any], device: str, channels_last: bool = False, ahead: int = 1
    ):
        self.items, self.ahead = items, max(1, ahead)
        self.device, self.channels_last = torch.device(device), channels_last
        self.stream = torch.cuda.Stream(self.device)
        self.queue: deque[Any] = deque()
        self.copies: OrderedDict[int, tuple[Any, Any, Any]] = OrderedDict()
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
            self.queue.append(item)
            self._copy(item[0])

    def _copy(self, batch: Any) -> None:
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.device, self.channels_last)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.copies[id(batch)] = (batch, moved, done)  # the batch held: its id stays its own
        while len(self.copies) > 2 * (self.ahead + 1):  # copies no pass asked for
            self.copies.popitem(last=False)

    def moved(self, batch: Any) -> Any | None:
        """`batch`'s device copy, ready for the current stream to read; None where there is
        none (it then moves as usual)."""
        entry = self.copies.pop(id(batch), None)
        if entry is None or entry[0] is not batch:
            return None
        _, moved, done = entry
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        for tensor in tensors_of(moved):
            tensor.record_stream(stream)
        return moved
