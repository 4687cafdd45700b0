"""A mixture-of-experts model's routing, seen from the training loop (runner.models.moe).

Each step: what one sequence weighs in the balance losses' gradient (`before_step`: a mean
over the global batch's sequences, through the engine's loss scale), the per-expert bias
moved from the step's global counts where the model balances that way (`after_step`, a
hook of the optimizer's step: one all-reduce of a small tensor, on the device), and on log
steps this rank's counts for the record (`sums`), summed over the ranks by the all-reduce
that brings the record its loss and read as figures there (`figures`): tokens per expert
(min, max, coefficient of variation) per layer, the balance losses' values, the share of
assignments dropped. A quiet step reads nothing on the host.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runner.models.moe import STAT_AUX, STAT_DROPPED, STAT_Z, MoE
from runner.spec.mesh import Layout


class Routing:
    def __init__(self, module: nn.Module, grid: Layout, engine: Any):
        """`module`: this rank's model (or its pipeline stages' modules)."""
        self.layers = [m for m in module.modules() if isinstance(m, MoE)]
        self.grid, self.engine = grid, engine
        first = self.layers[0] if self.layers else None
        self.experts = first.n_experts if first else 0
        self.count = max((m.state.layers for m in self.layers), default=0)
        self.width = self.experts + 3  # a layer's slots: its counts, dropped, aux, z
        self.balancing = any(m.bias_update_speed for m in self.layers)
        self.capacity = any(m.capacity_factor is not None for m in self.layers)
        self.weight = 1.0  # what one sequence's balance losses weigh this step
        self.sequences, self.logged = 0, False  # the step's
        self.sums: torch.Tensor | None = None  # the step's counts, once taken
        for layer in self.layers:
            layer.state.penalty_scale = self.penalty_scale
        self.stepping = False  # a training step's passes ran, its optimizer step not yet
        if self.balancing and engine.torch_optimizer is not None:  # as float8's scales are
            engine.torch_optimizer.register_step_post_hook(lambda *_: self.after_step())

    def penalty_scale(self) -> Any:
        """The gradient of the balance losses' sum (read in the backward pass)."""
        return self.weight * self.engine.backward_scale()

    def before_step(self, sequences: int, logged: bool) -> None:
        """A step of `sequences` sequences over every rank begins (`logged`: it makes a
        record): the counts start anew (a warm-up pass's are not the step's)."""
        if not self.layers:
            return
        self.weight = self.grid.gradient_weight(sequences)
        self.sequences, self.logged, self.sums = sequences, logged, None
        self.stepping = True
        for layer in self.layers:
            layer.state.take_stats()

    def after_step(self) -> None:
        """Bias balancing: every rank moves each layer's bias by the step's global counts.
        Run by the optimizer once it has stepped (a skipped step moves nothing), and only
        after a training step's passes (loading a checkpoint may step the optimizer once,
        at a learning rate of 0, to make its state)."""
        if not (self.balancing and self.stepping):
            return
        self.stepping = False
        import torch.distributed as dist

        total = self._sums().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        counts = total.view(self.count, self.width)[:, : self.experts]
        for layer in self.layers:
            layer.update_bias(counts[layer.state.layer])

    def record(self) -> tuple[torch.Tensor, Callable[[list[float]], dict[str, float]]] | None:
        """On a logged step, this rank's counts for its record, and what makes the record's
        figures of their sum over the ranks (see the module text); else None."""
        if not (self.layers and self.logged):
            return None
        return self._sums(), functools.partial(self.figures, sequences=self.sequences)

    def _sums(self) -> torch.Tensor:
        """The step's counts on this rank, every layer's slots (zero for the layers other
        ranks hold), taken from the layers once."""
        if self.sums is None:
            device = next(iter(self.layers[0].parameters())).device
            stats = torch.zeros(self.count, self.width, device=device)
            for layer in self.layers:
                taken = layer.state.take_stats()
                if taken is not None:
                    stats[layer.state.layer] += taken.to(device)
            # each rank of a tensor group routes the same tokens: one group's worth in the sum
            self.sums = stats.flatten() / self.grid.tensor
        return self.sums

    def figures(self, sums: list[float], sequences: int) -> dict[str, float]:
        """A record's routing figures, from the ranks' summed `sums`."""
        out: dict[str, float] = {}
        cvs, aux, z = [], 0.0, 0.0
        dropped = assigned = 0.0
        for index in range(self.count):
            slots = sums[index * self.width : (index + 1) * self.width]
            counts = slots[: self.experts]
            total = sum(counts)
            if total <= 0:
                continue
            mean = total / self.experts
            spread = math.sqrt(sum((c - mean) ** 2 for c in counts) / self.experts)
            cv = spread / mean
            cvs.append(cv)
            out[f"moe/layer{index}/tokens_min"] = min(counts)
            out[f"moe/layer{index}/tokens_max"] = max(counts)
            out[f"moe/layer{index}/tokens_cv"] = cv
            tail = slots[self.experts :]
            dropped, assigned = dropped + tail[STAT_DROPPED], assigned + total
            aux, z = aux + tail[STAT_AUX], z + tail[STAT_Z]
        if not cvs:
            return out
        layers = len(cvs)
        out["moe/tokens_cv"] = sum(cvs) / layers
        out["moe/aux_loss"] = aux / layers / max(sequences, 1)
        out["moe/z_loss"] = z / layers / max(sequences, 1)
        if self.capacity:
            out["moe/dropped"] = dropped / assigned
        return out
