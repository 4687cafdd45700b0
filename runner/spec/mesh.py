"""The ranks as a device mesh, in one place: what the engines shard over, what the sampler
splits the data by, and what the checkpoint and logging code count.

A run's ranks form a (pipeline, replicate, shard, tensor) grid, the tensor dimension
innermost: a tensor-parallel group is `tensor` consecutive ranks (on one node), which split
each layer between them and read the same batch. The pipeline dimension is outermost: stage
group p is the p-th block of world / pipeline consecutive ranks, holding its stage(s) of
the layers; the ranks of one pipeline (the same place in every stage group) read the same
batch. The data ranks are the product of the data dimensions, replicate x shard: each reads
its own part of the global batch. Without tensor or pipeline parallelism every rank is a
data rank (ddp, ZeRO, FSDP: shard; HSDP: replicate x shard).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PIPELINE, REPLICATE, SHARD, CONTEXT, TENSOR = "pipeline", "replicate", "shard", "context", "tensor"
EXPERT = "expert"  # the shard dimension's inner part under expert parallelism
SHARD_EXPERT = "shard_expert"  # the two as one: what the layers other than experts shard over
SHARD_CONTEXT = "shard_context"  # FSDP shards over both: context ranks hold parts of one batch


LONG_SEQUENCE = 2048  # tokens per sample from which a plan weighs context parallelism


@dataclass(frozen=True)
class Reach:
    """What bounds a dimension's degrees in a plan: the ranks, and the model's shape as the
    plan measured it (runner.layouts.model_facts)."""

    nproc: int  # ranks of a node
    world: int  # ranks of the run
    blocks: int = 0  # repeated blocks (a pipeline stage holds one at least)
    heads: int | None = None  # attention heads, where the model says
    sequence: int | None = None  # tokens a sample
    experts: int = 0  # experts of each mixture-of-experts layer


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Dimension:
    """One dimension of fsdp's mesh, declared once: its key (`parallelism.<name>`, and its
    name in the device mesh), its heading in docs/parallelism.md's table of what composes
    (generated from these, docs/hooks/composition_table.py), the dimensions it does not
    compose with yet (refused before any rank starts), how it composes with compile, the
    room that splits a model by it, and the degrees a plan weighs for it.

    A dimension's room (a module of runner.models, imported only where a model is at hand)
    answers `spec_problems(model, spec)`: what a run of `spec` finds wrong with the model
    (preflight, on the model built on the meta device), and `offered(model)`: whether the
    model has a plan of its own for this split (a plan weighs the dimension's degrees only
    then); its `apply_*` function splits the model (runner.train.build.parallelize).
    `degrees(reach)`: the degrees a plan weighs (1 among them), before the mesh arithmetic
    (`degree_problems`) and the spec's checks say which layouts hold."""

    name: str
    heading: str
    not_yet: tuple[str, ...] = ()
    compiles: str = "yes"
    room: str = ""
    degrees: Callable[[Reach], list[int]] | None = None

    def answers(self, question: str) -> Callable[..., Any]:
        """The room's function `question` (spec_problems, offered)."""
        import importlib

        return getattr(importlib.import_module(self.room), question)


def _stage_degrees(reach: Reach) -> list[int]:  # a block per stage at least
    return [p for p in divisors(reach.world) if p <= max(1, reach.blocks)]


def _expert_degrees(reach: Reach) -> list[int]:  # groups that share the experts out evenly
    return [e for e in divisors(reach.world) if reach.experts % e == 0]


def _sequence_degrees(reach: Reach) -> list[int]:  # long sequences, split within a node
    return divisors(reach.nproc) if (reach.sequence or 0) >= LONG_SEQUENCE else [1]


def _tensor_degrees(reach: Reach) -> list[int]:  # within a node, dividing the heads
    return [t for t in divisors(reach.nproc) if reach.heads is None or reach.heads % t == 0]


# in the device mesh's order, outermost first (runner.engines.device_mesh)
DIMENSIONS = (
    Dimension(
        PIPELINE,
        "`pipeline`",
        compiles="yes (per block)",
        room="runner.models.pipeline_stages",
        degrees=_stage_degrees,
    ),
    Dimension(REPLICATE, "`replicate` (HSDP)"),
    Dimension(SHARD, "`shard` (fsdp)"),
    Dimension(
        EXPERT,
        "`expert`",
        not_yet=(CONTEXT,),
        room="runner.models.expert_split",
        degrees=_expert_degrees,
    ),
    Dimension(
        CONTEXT,
        "`context`",
        not_yet=(PIPELINE,),
        room="runner.models.context_split",
        degrees=_sequence_degrees,
    ),
    Dimension(TENSOR, "`tensor`", room="runner.models.tensor_plans", degrees=_tensor_degrees),
)
SPLITS = tuple(d for d in DIMENSIONS if d.room)  # the dimensions that split the model


def dimension_problems(model: Any, spec: Any) -> list[str]:
    """What each dimension's room finds wrong with the run's model (see Dimension)."""
    return [p for d in SPLITS for p in d.answers("spec_problems")(model, spec)]


def offered_splits(model: Any) -> list[str]:
    """The dimensions `model` has plans of its own for (see Dimension)."""
    return [d.name for d in SPLITS if d.answers("offered")(model)]


def composes(one: str, other: str) -> bool:
    """Whether dimensions `one` and `other` train together (either way round)."""
    by_name = {d.name: d for d in DIMENSIONS}
    return other not in by_name[one].not_yet and one not in by_name[other].not_yet


def all_compose(sizes: dict[str, int]) -> bool:
    """Whether every pair of dimensions above 1 in `sizes` (by name) composes."""
    split = [name for name, size in sizes.items() if size > 1]
    return all(composes(a, b) for i, a in enumerate(split) for b in split[i + 1 :])


def composition_problems(grid: Layout) -> list[str]:
    """Each pair of the grid's dimensions that does not compose yet, named by its keys."""
    sizes = {d.name: getattr(grid, d.name) for d in DIMENSIONS}
    return [
        f"parallelism.{d.name}={sizes[d.name]}: not with parallelism.{other} yet"
        for d in DIMENSIONS
        for other in d.not_yet
        if sizes[d.name] > 1 and sizes[other] > 1
    ]


@dataclass(frozen=True)
class Layout:
    replicate: int = 1
    shard: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1  # groups of data ranks (within shard) that split each layer's experts

    @property
    def world(self) -> int:
        return self.pipeline * self.stage_world

    @property
    def splits(self) -> dict[str, int]:
        """The degree of each dimension that splits the model (SPLITS), by name."""
        return {d.name: getattr(self, d.name) for d in SPLITS}

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage group (every rank without pipeline parallelism)."""
        return self.replicate * self.shard * self.context * self.tensor

    @property
    def copies(self) -> int:
        """Ranks that read each part of a batch: a context group of tensor groups, in every
        stage."""
        return self.pipeline * self.context * self.tensor

    @property
    def data_world(self) -> int:
        """Ranks that read their own part of each batch."""
        return self.replicate * self.shard

    def data_rank(self, rank: int) -> int:
        """Which part of the batch `rank` reads: its tensor group's."""
        return (rank % self.stage_world) // (self.context * self.tensor)

    def context_rank(self, rank: int) -> int:
        """Which part of the sequence `rank` computes in its context group."""
        return (rank // self.tensor) % self.context

    def pipeline_rank(self, rank: int) -> int:
        """Which stage group `rank` is in (0: it holds the first stage)."""
        return rank // self.stage_world

    def counts_items(self, rank: int) -> bool:
        """Whether `rank` counts its batch's samples and tokens for the throughput: one rank
        of each tensor group, in the first stage group (each rank of a context group counts
        its part of the sequence)."""
        return self.tensor_rank(rank) == 0 and self.pipeline_rank(rank) == 0

    def tensor_rank(self, rank: int) -> int:
        """Where `rank` sits in its tensor-parallel group."""
        return rank % self.tensor

    def gradient_weight(self, items: Any) -> Any:
        """What a rank's loss sum is multiplied by before its backward pass: the engines
        average the gradients over the data ranks, and this makes that a mean over the
        `items` of the whole global batch. FSDP reduces over the context ranks too, whose
        losses are parts of one batch's."""
        return self.data_world * self.context / items

    def loss_share(self, loss_sum: Any) -> Any:
        """This rank's part of a step's loss sum, the parts summed over every rank: the
        ranks of a tensor group each hold their group's whole sum (under pipeline
        parallelism only the last stage's hold one; the others' is zero)."""
        return loss_sum / self.tensor if self.tensor > 1 else loss_sum


@dataclass(frozen=True)
class BatchSplit:
    """How a step's global batch is cut on one rank: the one place a rank reads grad_accum,
    the data ranks and the microbatch size from."""

    global_batch: int  # samples per optimizer step, every rank together
    data_world: int  # ranks that read their own part of each batch
    data_rank: int  # which part this rank reads
    accum: int  # microbatches a rank's share is cut into (grad_accum=auto: 1 to start with)
    auto: bool = False  # grad_accum=auto: cut finer, while training, where memory runs out

    @property
    def per_rank(self) -> int:
        """Samples of a step each data rank reads."""
        return self.global_batch // self.data_world

    @property
    def micro_batch_size(self) -> int:
        return self.per_rank // self.accum


def batch_split(spec: Any, grid: Layout, rank: int) -> BatchSplit:
    """The split of `spec`'s global batch for global rank `rank` of `grid`."""
    auto = spec.grad_accum == "auto"
    accum = 1 if auto else spec.grad_accum
    return BatchSplit(spec.global_batch_size, grid.data_world, grid.data_rank(rank), accum, auto)


def layout(spec: Any, world: int | None = None) -> Layout:
    """The run's grid: the world size (the spec's, or the running group's `world`) split by
    parallelism.pipeline, .replicate and .tensor (fsdp's; every other parallelism is data-parallel
    over every rank)."""
    world = spec.world_size if world is None else world
    options = spec.parallelism
    replicate, tensor, pipeline = options.replicas, options.tensor, options.pipeline
    context, expert = options.context, options.expert
    shard = max(1, world // (pipeline * replicate * context * tensor))  # checked: spec
    return Layout(replicate, shard, tensor, pipeline, context, expert)


def layout_problems(spec: Any) -> list[str]:
    """What is wrong with the grid of a resolved `spec` (fsdp's replicate set); see
    degree_problems."""
    options = spec.parallelism
    degrees = {d.name: getattr(options, d.name) for d in SPLITS}
    return degree_problems(spec.world_size, spec.nproc, options.replicas, degrees)


def degree_problems(world: int, nproc: int, replicate: int, degrees: dict[str, int]) -> list[str]:
    """What is wrong with a grid of `world` ranks, `nproc` a node, `replicate` copies and the
    model splits' `degrees` (by dimension name): its degrees against the world size and a
    node's ranks, each problem naming its key and what is valid, and the dimensions that do
    not compose yet. The one place the mesh arithmetic is checked (a run's spec, a plan's
    candidates); `layout` then holds."""
    tensor, expert = degrees[TENSOR], degrees[EXPERT]
    pipeline = degrees[PIPELINE] * degrees[CONTEXT]  # the dimensions beside replicate x shard
    if world % pipeline:
        groups = {"pipeline": degrees[PIPELINE], "context": degrees[CONTEXT]}
        given = " x ".join(f"parallelism.{k}={v}" for k, v in groups.items() if v > 1)
        return [
            f"{given}: groups of equal size must divide the world size nproc x nodes = "
            f"{world}; valid: {_divisors(world)}"
        ]
    if nproc % tensor:
        return [
            f"parallelism.tensor={tensor}: a tensor-parallel group is ranks of one node, so it "
            f"must divide nproc={nproc}; valid: {_divisors(nproc)}"
        ]
    if world % (pipeline * replicate * tensor):
        rest = world // (pipeline * tensor)
        if tensor > 1:
            return [
                f"parallelism.replicate={replicate}: replicate x shard x tensor must be the "
                f"world size nproc x nodes = {world}, so with parallelism.tensor={tensor} "
                f"replicate must divide {rest}; valid: {_divisors(rest)}"
            ]
        return [
            f"parallelism.replicate={replicate}: must divide the world size nproc x nodes "
            f"= {world}; valid: {_divisors(rest)}"
        ]
    shard = world // (pipeline * replicate * tensor)
    grid = Layout(replicate, shard, tensor, degrees[PIPELINE], degrees[CONTEXT], expert)
    if grid.shard % grid.expert:
        return [
            f"parallelism.expert={grid.expert}: must divide the shard ranks ({grid.shard} = "
            f"world {grid.world} / (pipeline x replicate x context x tensor)), which the "
            f"expert groups are cut from, and each layer's experts; valid: {_divisors(grid.shard)}"
        ]
    return composition_problems(grid)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in divisors(n))
