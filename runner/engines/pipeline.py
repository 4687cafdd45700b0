"""Pipeline parallelism on fsdp's mesh (parallelism.pipeline=P): the model cut into stages
(runner.models.pipeline_stages), each stage group of world / P ranks holding its stage(s),
sharded by FSDP2 over the group's data ranks; torch.distributed.pipelining runs a step's
microbatches through them by its schedule.

The pipeline's microbatches are the step's `grad_accum` microbatches, so a step trains on
the same samples with the same weighting as every other split (space-time equivalence): the
schedule sums the microbatches' losses, each already weighted by the items of the whole
global batch (`scale_grads=False`). Gradients of the stages' parameters never cross stages;
the global gradient norm adds the stages' squares. Evaluation runs the stages forward in
order, one batch at a time, the activations sent from rank to rank (any batch shape);
model.pt gathers every stage's tensors to rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runner.engines.base import FinalTensor
from runner.engines.device_mesh import pipeline_mesh, tensor_mesh
from runner.engines.rank_model import ELSEWHERE, Elsewhere
from runner.models.pipeline_stages import StagedModel, cut_stages
from runner.models.pretrained import unwrapped_name
from runner.spec.mesh import Layout
from runner.spec.parallelism_specs import ONE_STAGE_PER_RANK

# parallelism.pipeline_schedule -> torch's schedule class (torch.distributed.pipelining)
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # ndim, dtype, then up to 6 sizes


def stage_indices(pp_rank: int, pipeline: int, per_rank: int) -> list[int]:
    """The stages of stage group `pp_rank`: looped (r, r+P, ...)."""
    return [pp_rank + v * pipeline for v in range(per_rank)]


def whole_groups(spec: Any, model: nn.Module) -> list[list[str]]:
    """The names in each optimizer group of the whole model (what a ddp checkpoint's
    positions count in)."""
    from runner.engines.optim import named_parameters, parameter_groups

    names = {id(p): name for name, p, _ in named_parameters(model)}
    return [[names[id(p)] for p in g["params"]] for g in parameter_groups(spec.optimizer, model)]


def cropped(output: Any, time: int) -> Any:
    """A last stage's output at the inputs' length `time`: a first stage padded the
    sequence to a multiple of the tensor group (the padding at the end, where causal
    attention keeps every real position from seeing it)."""
    if time and isinstance(output, torch.Tensor) and output.dim() > 2 and output.shape[1] > time:
        return output[:, :time]
    return output


class Pipeline:
    def __init__(
        self, spec: Any, model: nn.Module, grid: Layout, mesh: Any, device: str, microbatches: int
    ):
        """`microbatches`: a step's, each rank's share cut so (grad_accum)."""
        options = spec.parallelism
        self.schedule_name = options.pipeline_schedule
        self.per_rank = options.stages_each
        self.count = grid.pipeline * self.per_rank
        self.group = pipeline_mesh(mesh).get_group()
        self.grid, self.device, self.rank = grid, device, dist.get_rank()
        self.pp_rank = grid.pipeline_rank(self.rank)
        self.owner = {
            s: r
            for r in range(grid.pipeline)
            for s in stage_indices(r, grid.pipeline, self.per_rank)
        }
        self.indices = sorted(s for s, r in self.owner.items() if r == self.pp_rank)
        split, plan = options.pipeline_split, options.pp_plan
        tensors = tensor_mesh(mesh) if grid.tensor > 1 else None
        self.parts = cut_stages(model, self.indices, self.count, split, plan, tensors)
        self.has_first, self.has_last = 0 in self.indices, self.count - 1 in self.indices
        self.module = StagedModel(model, self.parts, self.relay)
        names = [n for n, _ in (*model.named_parameters(), *model.named_buffers())]
        self.order = {unwrapped_name(n): i for i, n in enumerate(names)}  # model.pt's order
        self.microbatches = microbatches
        self.whole_groups = whole_groups(spec, model)
        self._schedule: Any = None
        self._shape: tuple[Any, ...] = ()
        self._time = 0  # the inputs' length (a first stage may pad them)
        self._loss: Callable[[Any, Any], torch.Tensor] | None = None

    # ---------------------------------------------------------------- training

    def run(self, inputs: torch.Tensor, targets: Any, loss: Callable[[Any, Any], Any]) -> None:
        """A step's forward and backward passes: `inputs` (the rank's microbatches, one
        after the other) through the schedule, `loss(output, target)` on the last stage of
        each microbatch, `targets` split as the inputs are (the caller may pass each
        microbatch's index). Gradients are left in the parameters."""
        shape = (tuple(inputs.shape), inputs.dtype)
        if self._schedule is None or shape != self._shape:  # built for one shape of input
            self._schedule, self._shape = self._build(), shape
        self._loss, self._time = loss, inputs.shape[1] if inputs.dim() > 1 else 0
        args = (inputs,) if self.has_first else ()
        self._schedule.step(*args, target=targets if self.has_last else None)

    def _call_loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss is not None
        return self._loss(cropped(output, self._time), target)

    def _build(self) -> Any:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleSingle,
            get_schedule_class,
        )

        try:
            schedule = get_schedule_class(SCHEDULES[self.schedule_name])
        except ValueError:
            raise ValueError(
                f"parallelism.pipeline_schedule={self.schedule_name}: torch "
                f"{torch.__version__} does not have it; valid: {', '.join(ONE_STAGE_PER_RANK)}"
            ) from None
        device = torch.device(self.device)
        stages = [
            PipelineStage(part, index, self.count, device, group=self.group)
            for part, index in zip(self.parts, self.indices, strict=True)
        ]
        given = stages[0] if issubclass(schedule, PipelineScheduleSingle) else stages
        return schedule(given, self.microbatches, loss_fn=self._call_loss, scale_grads=False)

    def grad_norm(self, square: torch.Tensor) -> torch.Tensor:
        """The global gradient norm from this stage group's square of it."""
        square = square.clone()
        dist.all_reduce(square, group=self.group)
        return square.sqrt()

    # ---------------------------------------------------------------- evaluation

    def relay(self, parts: list[nn.Module], x: torch.Tensor) -> torch.Tensor | Elsewhere:
        """The stages forward in order, activations sent to the next stage's rank; the
        logits on the last stage's ranks, ELSEWHERE on the others."""
        mine = dict(zip(self.indices, parts, strict=True))
        time = x.shape[1] if x.dim() > 1 else 0
        for index in range(self.count):
            if index not in mine:
                continue
            if index > 0 and index - 1 not in mine:
                x = self._receive(self.owner[index - 1])
            x = mine[index](x)
            if index < self.count - 1 and index + 1 not in mine:
                self._send(x, self.owner[index + 1])
        return cropped(x, time) if self.has_last else ELSEWHERE

    def _peer(self, pp_rank: int) -> int:
        """The global rank at `pp_rank` in this rank's pipeline."""
        return dist.get_global_rank(self.group, pp_rank)

    def _send(self, x: torch.Tensor, pp_rank: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = x.dim(), _DTYPES.index(x.dtype)
        header[2 : 2 + x.dim()] = torch.tensor(x.shape)
        dist.send(header, self._peer(pp_rank))
        dist.send(x.contiguous(), self._peer(pp_rank))

    def _receive(self, pp_rank: int) -> torch.Tensor:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, self._peer(pp_rank))
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        x = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=self.device)
        dist.recv(x, self._peer(pp_rank))
        return x

    # ---------------------------------------------------------------- model.pt

    def final_tensors(self, local: list[FinalTensor]) -> list[FinalTensor]:
        """model.pt's tensors from every stage, in the whole model's order: the stage that
        holds one gathers it whole (FSDP), and its first rank sends it to rank 0."""
        held = {t.name: t for t in local}
        listed = [(t.name, tuple(t.shape), t.dtype) for t in local]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, listed)
        leaders = [r * self.grid.stage_world for r in range(self.grid.pipeline)]
        entries = [(name, shape, dtype, r) for r in leaders for name, shape, dtype in everyone[r]]
        entries.sort(key=lambda e: self.order.get(unwrapped_name(e[0]), len(self.order)))
        return [
            FinalTensor(
                name, torch.Size(shape), dtype, self._gather(held.get(name), shape, dtype, src)
            )
            for name, shape, dtype, src in entries
        ]

    def _gather(
        self, tensor: FinalTensor | None, shape: tuple[int, ...], dtype: torch.dtype, src: int
    ) -> Callable[[], torch.Tensor]:
        def gather() -> torch.Tensor:
            value = tensor.gather() if tensor is not None else None  # the stage's collective
            if src == 0:
                return value if value is not None else torch.empty(0)
            if self.rank == src:
                dist.send(value.contiguous(), 0)
            elif self.rank == 0:
                value = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(value, src)
            return value if value is not None else torch.empty(0)

        return gather
