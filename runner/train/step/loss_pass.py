"""One microbatch's forward pass and its loss, as the training step, DDP's warm-up pass and
the evaluation run it: on the device (channels_last where asked), under the precision's
autocast, with the fault-injection hooks of chaos.* (training only)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from runner.engines.base import Engine
from runner.engines.loss_parallel import loss_of
from runner.engines.precision import autocast
from runner.engines.rank_model import ELSEWHERE, SAME_POSITIONS, Pairing
from runner.spec import RunSpec
from runner.spec.mesh import BatchSplit, Layout
from runner.train.step.batch_parts import logits_of, split, to_device
from runner.train.step.device_feed import DeviceCopy, DeviceFeed, copy_of, wanted
from runner.train.step.routing import Routing


class FaultHooks(Protocol):
    """Where chaos.* injects its faults into a training pass (runner.train.guards.chaos)."""

    def forward(self, batch: Any) -> None: ...

    def loss(self, loss: torch.Tensor) -> torch.Tensor: ...


class LossPass:
    def __init__(
        self,
        spec: RunSpec,
        engine: Engine,
        loss_fn: Any,
        *,
        device: str,
        faults: FaultHooks,
        split: BatchSplit,
        channels_last: bool = False,
        pairing: Pairing = SAME_POSITIONS,
        streaming: bool = False,
        routing: Routing | None = None,
    ):
        """`pairing`: how this rank's logits meet their targets (the plan's); `streaming`:
        the training set is an iterable one (see runner.train.step.device_feed); `routing`:
        the model's mixture-of-experts layers, whose balance losses join the gradient."""
        self.spec, self.engine, self.loss_fn, self.faults = spec, engine, loss_fn, faults
        self.routing = routing or Routing(nn.Module(), Layout(), engine)  # none: does nothing
        self.device, self.channels_last, self.pairing = device, channels_last, pairing
        self.device_type = torch.device(device).type
        # CUDA graphs (compile.mode=reduce-overhead): each pass starts a new replay, so the
        # outputs of the one before may be overwritten (none is read after its pass)
        graphs = spec.compile is not None and spec.compile.captures_graphs
        self.new_replay = graphs and self.device_type == "cuda"
        self.prefetch = wanted(spec.input_prefetch, device, streaming) and not split.auto
        self.ahead = split.accum  # the next step's microbatches, drawn ahead

    def feed(self, items: Iterator[Any]) -> Iterator[Any]:
        """The training loader's `items`, their batches copied to the device ahead where
        input_prefetch applies (runner.train.step.device_feed)."""
        if not self.prefetch:
            return items
        return DeviceFeed(items, self.device, self.channels_last, self.ahead)

    def train(
        self, batch: Any, real: bool, copy: DeviceCopy | None = None
    ) -> tuple[torch.Tensor, Any, Any]:
        """A training microbatch: (loss, items, targets). `copy`: the batch's device copy,
        made ahead (input_prefetch)."""
        self.faults.forward(batch)
        logits, targets = self.forward(batch, copy=copy)
        loss, count = self._loss(logits, targets, real)
        return self.faults.loss(loss), count, targets

    def loss(self, batch: Any, real: bool = True) -> tuple[torch.Tensor, Any]:
        """(summed loss, items) of one microbatch."""
        return self._loss(*self.forward(batch), real)

    def forward(
        self, batch: Any, model: Any = None, copy: DeviceCopy | None = None
    ) -> tuple[Any, Any]:
        """(logits, targets) of one microbatch: through the engine's model, or `model` (an
        evaluation's: the bare module), as the plan's pairing lays them out for this rank's
        loss; ELSEWHERE for logits where the model's output is on other ranks."""
        if copy is not None:
            moved = copy.ready(torch.device(self.device))
        else:
            moved = to_device(batch, self.device, self.channels_last)
        args, kwargs, targets = split(moved)
        if self.new_replay:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(self.spec.precision, self.device_type):
            outputs = (self.engine.model if model is None else model)(*args, **kwargs)
        if outputs is ELSEWHERE:
            return ELSEWHERE, targets
        return self.pairing.local(logits_of(outputs), targets)

    def tokens(self, targets: Any) -> int:
        """The tokens of a microbatch's `targets` (as forward returned them) this rank ran."""
        if not isinstance(targets, torch.Tensor):
            return 0
        return self.pairing.tokens(targets)

    def warm_up(self, microbatch: tuple[Any, ...]) -> None:
        """A forward and backward pass whose gradients are discarded (Engine.warm_up)."""
        logits, targets = self.forward(microbatch[0], copy=copy_of(microbatch))
        loss, _ = self._loss(logits, targets, microbatch[1])
        (loss * 0.0).backward()

    def _loss(self, logits: Any, targets: Any, real: bool) -> tuple[torch.Tensor, Any]:
        loss, count = loss_of(self.loss_fn, logits, targets)
        if not real:  # a placeholder: runs for the collectives, counts nothing
            loss = loss * 0.0
        return loss, count
