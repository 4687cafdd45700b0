"""The `parallelism` group's options: one dataclass each (ddp, zero1/zero2, zero3, fsdp),
told apart by their `name` field; the keys of conf/parallelism/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from runner.spec.bounds import bound as _bound


class Unsplit:
    """What a parallelism that splits no model (ddp, ZeRO) says of the keys only fsdp's mesh
    has: every degree 1, no plan of the user's, nothing wrapped on its own, built whole. Every
    parallelism spec so answers every degree; none is a key of these options (a user's
    `parallelism.tensor=2` under ddp is refused as not one)."""

    tensor: ClassVar[int] = 1
    pipeline: ClassVar[int] = 1
    context: ClassVar[int] = 1
    expert: ClassVar[int] = 1
    replicas: ClassVar[int] = 1
    stages_each: ClassVar[int] = 1
    pipeline_split: ClassVar[tuple[int, ...]] = ()
    tp_plan: ClassVar[None] = None
    pp_plan: ClassVar[None] = None
    ep_plan: ClassVar[None] = None
    wrap: ClassVar[tuple[str, ...]] = ()
    meta_init: ClassVar[bool] = False


@dataclass(frozen=True)
class DDPSpec(Unsplit):
    """torch DistributedDataParallel; every rank holds the full optimizer state."""

    name: Literal["ddp"] = "ddp"
    syncs_gradients_itself: ClassVar[bool] = False  # True for engines that ignore sync_strategy
    find_unused_parameters: bool = False
    bucket_cap_mb: float = _bound(25.0, gt=0.0)
    gradient_as_bucket_view: bool | None = None  # null: true unless multi_auto_sync
    static_graph: bool = False
    shm_allreduce: bool | None = None  # null: on where it applies (cpu, one machine, x86-64)


@dataclass(frozen=True)
class ZeroSpec(Unsplit):
    """DeepSpeed ZeRO: stage 1 partitions optimizer state, stage 2 also gradients."""

    name: Literal["zero1", "zero2"] = "zero2"
    syncs_gradients_itself: ClassVar[bool] = True
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = _bound(500_000_000, min=1)
    allgather_bucket_size: int = _bound(500_000_000, min=1)
    offload_optimizer: Literal["none", "cpu"] = "none"
    deepspeed_config: dict[str, Any] = field(default_factory=dict)

    @property
    def stage(self) -> int:
        return int(self.name[-1])


@dataclass(frozen=True)
class Zero3Spec(Unsplit):
    """DeepSpeed ZeRO stage 3: parameters partitioned too, gathered block by block."""

    name: Literal["zero3"] = "zero3"
    syncs_gradients_itself: ClassVar[bool] = True
    stage: ClassVar[int] = 3
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    # Not DeepSpeed's own defaults (5e8, 5e7, 1e9, 1e9): with those a rank holds every
    # gathered parameter from forward to backward (prefetched ones, and any within the reuse
    # distance), a bucket that fills with every gradient, and optimizer temporaries the size
    # of its whole partition: each a whole copy of a model below 0.5B parameters.
    reduce_bucket_size: int = _bound(5_000_000, min=1)
    prefetch_bucket_size: int = _bound(0, min=0)
    sub_group_size: int = _bound(10_000_000, min=1)
    param_persistence_threshold: int = _bound(100_000, min=0)
    max_live_parameters: int = _bound(1_000_000_000, min=1)
    max_reuse_distance: int = _bound(0, min=0)
    offload_param: Literal["none", "cpu"] = "none"
    offload_optimizer: Literal["none", "cpu"] = "none"
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    meta_init: bool = True  # no rank holds the whole model: built partitioned (zero.Init)


DeepSpeedSpec = ZeroSpec | Zero3Spec
DEEPSPEED_SPECS = (ZeroSpec, Zero3Spec)


ONE_STAGE_PER_RANK = ("gpipe", "1f1b")  # pipeline schedules of one stage per rank


@dataclass(frozen=True)
class FSDPSpec:
    """PyTorch FSDP2: parameters, gradients and optimizer state sharded, block by block."""

    name: Literal["fsdp"] = "fsdp"
    syncs_gradients_itself: ClassVar[bool] = True
    reshard_after_forward: bool = True  # free gathered weights after forward (ZeRO-3-like)
    cpu_offload: bool = False  # parameters, gradients and optimizer state in CPU memory
    wrap: tuple[str, ...] = ()  # block classes to shard on their own; () = found automatically
    meta_init: bool = True  # no rank holds the whole model: built on meta, shards filled in
    # HSDP: `replicate` groups of world/replicate ranks, each group holding a whole sharded
    # copy; null = nodes (shard within a node, replicate across nodes)
    replicate: int | None = _bound(None, min=1)
    # tensor parallelism: groups of `tensor` ranks (within a node) split each layer; 1 = none
    tensor: int = _bound(1, min=1)
    # a plan of the user's: {_target_: pkg.module.fn}, fn(model, mesh) splitting the model;
    # null: the model's own (runner's gpt, a Hugging Face model's base_model_tp_plan)
    tp_plan: dict[str, Any] | None = None
    # pipeline parallelism: the layers cut into stages over `pipeline` groups of ranks, the
    # mesh's outermost dimension; the schedule runs the step's grad_accum microbatches
    pipeline: int = _bound(1, min=1)
    pipeline_schedule: Literal[
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "looped_bfs",
    ] = "1f1b"
    stages_per_rank: int | None = _bound(None, min=1)  # null: 1, or 2 for the multi-stage ones
    pipeline_split: tuple[int, ...] = ()  # blocks per stage; () = as many each
    # a cut of the user's: {_target_: pkg.module.fn}, fn(model, stage, stages) -> the stage's
    # module; null: the model's own (runner's gpt, a Hugging Face decoder)
    pp_plan: dict[str, Any] | None = None
    # context parallelism: groups of `context` ranks split each sequence for attention
    context: int = _bound(1, min=1)
    # expert parallelism: groups of `expert` data ranks split each mixture-of-experts layer's
    # experts between them, tokens sent to their experts and back by all-to-all
    expert: int = _bound(1, min=1)
    # the experts modules it splits, by name pattern (`*` a layer number), each of Hugging
    # Face's shape (runner.models.expert_dispatch); null: the model's own (gpt_moe's MoE
    # layers, a Hugging Face model's base_model_ep_plan)
    ep_plan: tuple[str, ...] | dict[str, Any] | None = None

    @property
    def stages_each(self) -> int:
        """Pipeline stages per rank: stages_per_rank, or 1 for the schedules of one stage per
        rank and 2 for the others."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if self.pipeline_schedule in ONE_STAGE_PER_RANK else 2

    @property
    def replicas(self) -> int:
        """Copies of the model (an unresolved null: one node's, so 1)."""
        return self.replicate or 1


ParallelismSpec = DDPSpec | ZeroSpec | Zero3Spec | FSDPSpec


@dataclass(frozen=True)
class AutoSpec:
    """parallelism=auto: the parent plans the layout (runner.layouts) and puts the chosen
    engine's keys in its place before the spec is resolved; no run spec holds it."""

    name: Literal["auto"] = "auto"
    tensor: int | None = _bound(None, min=1)  # a degree given is kept; null: planned
    pipeline: int | None = _bound(None, min=1)
    context: int | None = _bound(None, min=1)
    expert: int | None = _bound(None, min=1)
    replicate: int | None = _bound(None, min=1)
