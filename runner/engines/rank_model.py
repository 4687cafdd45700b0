"""How one rank's model is distributed: what runner.train.build.parallelize decides, once,
and hands to the engine, which then only steps, checkpoints and clips.

A RankModel names what this rank holds (the model, or its pipeline stages under one module), the
modules that are sharded one by one (`blocks`) and as wholes (`roots`), the run's grid and
device mesh, and the few answers a parallelism gives the engine without the engine knowing
which parallelism it is: how this rank's gradient norm joins the other stages', which
tensors make model.pt, where a loss's backward runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from runner.spec.mesh import Layout

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.engines.base import FinalTensor

Fill = Callable[["nn.Module"], None]
"""Fills in a rank's shards of a model built without its weights, once the engine sharded
it and before it builds the optimizer (runner.train.build.sharded_init)."""


class Stages(Protocol):
    """What the engine asks of the stages a model is cut into (runner.engines.pipeline), or
    of the whole model where it is not cut (`WHOLE_MODEL`)."""

    count: int  # stages in the run
    whole_groups: list[list[str]] | None  # the whole model's optimizer groups, by name

    def grad_norm(self, square: torch.Tensor) -> torch.Tensor:
        """The global gradient norm from this rank's stages' square of it."""

    def final_tensors(self, local: list[FinalTensor]) -> list[FinalTensor]:
        """model.pt's tensors, from this rank's `local` ones."""


class WholeModel:
    """One stage: every rank holds (its shards of) the whole model."""

    count = 1
    whole_groups = None

    def grad_norm(self, square: torch.Tensor) -> torch.Tensor:
        return square.sqrt()

    def final_tensors(self, local: list[FinalTensor]) -> list[FinalTensor]:
        return local


WHOLE_MODEL = WholeModel()


class Pairing(Protocol):
    """How this rank's logits meet their targets for the loss (a split of the sequence
    across ranks pairs its own positions: runner.models.context_split)."""

    def local(self, logits: Any, targets: Any) -> tuple[Any, Any]:
        """(logits, targets) as the loss reads them on this rank."""

    def tokens(self, targets: torch.Tensor) -> int:
        """The tokens of `targets` (as `local` laid them out) this rank computed."""


class SamePositions:
    """Every rank computes every position of its batch: logits and targets as they are."""

    def local(self, logits: Any, targets: Any) -> tuple[Any, Any]:
        return logits, targets

    def tokens(self, targets: torch.Tensor) -> int:
        return targets.numel()


SAME_POSITIONS = SamePositions()


class Elsewhere:
    """What a forward pass returns on a rank that does not hold the model's output (the
    earlier stages of a pipeline): the output is on other ranks, nothing to score here."""

    def __repr__(self) -> str:
        return "ELSEWHERE"


ELSEWHERE = Elsewhere()


@dataclass(frozen=True)
class Apart:
    """Modules of a block a sharding engine shards on a mesh of their own, before the block:
    under expert parallelism, an expert group's experts, over the data ranks but the group's
    (each group holds every expert once). Their gradient sums over `mesh`'s ranks, then
    divides by `divide` beyond the engine's own mean over `mesh` (an expert's gradient has
    summed its whole group's tokens already)."""

    module: nn.Module
    mesh: Any
    divide: int = 1


@dataclass
class RankModel:
    grid: Layout  # the run's dimensions, computed once per rank
    device: str
    module: nn.Module  # what this rank holds, under the whole model's names
    total_steps: int  # optimizer steps the schedule is built for
    fill: Fill | None = None  # built without weights: fills this rank's shards once sharded
    mesh: Any = None  # the run's DeviceMesh, where one is made (made once per process)
    roots: list[nn.Module] = field(default_factory=list)  # sharded each as a model of its own
    blocks: list[nn.Module] = field(default_factory=list)  # sharded one by one, held here
    apart: dict[int, list[Apart]] = field(default_factory=dict)  # by id(block): before it
    stages: Stages = WHOLE_MODEL
    loss_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    """Where a microbatch's forward and backward run (tensor parallelism: loss parallel)."""
    pairing: Pairing = SAME_POSITIONS  # how the loss pairs this rank's logits and targets
    several_meshes: bool = False  # gradients on more than the data mesh: norms reduced by hand
    keep_last_gathered: bool = True  # the last block keeps its gathered weights for backward
    keep_every_gathered: bool = False  # every block does (each microbatch would gather again)
