"""The typed run spec: one frozen dataclass per config group, one for the run.

The YAML in conf/ is the user-facing default; these classes are the schema it
must satisfy. `runner.spec.convert` turns a composed config into a `RunSpec`
and reports every problem at once. Field metadata carries value constraints
(`min`, `gt`, `max`) so the error for a bad value names the bound.

Groups whose options differ in shape (parallelism) are unions of dataclasses told apart
by their `name` field. The groups that take the user's own code (model, data, loss,
metrics, optimizer, scheduler) are components: `_target_` plus arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Literal

from runner.components import TARGET
from runner.spec.bounds import bound as _bound
from runner.spec.device_specs import CompileSpec, MfuSpec, ProfileSpec  # noqa: F401
from runner.spec.guard_specs import ChaosSpec, EarlyStopSpec, LossSpikeSpec, WatchdogSpec
from runner.spec.parallelism_specs import (  # noqa: F401  (the schema's names, re-exported)
    DEEPSPEED_SPECS,
    DDPSpec,
    DeepSpeedSpec,
    FSDPSpec,
    ParallelismSpec,
    Zero3Spec,
    ZeroSpec,
)
from runner.spec.plan_specs import PlanSpec
from runner.spec.tracker_specs import TensorBoardTrackerSpec, TrackersSpec


class SyncStrategy(str, Enum):
    """How DDP synchronises gradients across the microbatches of one step."""

    AUTO = "auto"
    """Pick for me: multi_auto_sync when unused parameters are expected, else single_auto_sync."""
    SINGLE_AUTO_SYNC = "single_auto_sync"
    """All-reduce only in the final microbatch's backward (no_sync before it). Least traffic."""
    MULTI_AUTO_SYNC = "multi_auto_sync"
    """All-reduce in every microbatch's backward. Needed when the set of used parameters varies."""
    FORCED_SYNC = "forced_sync"
    """Never let DDP sync; average the gradients by hand once after the final microbatch."""


class Precision(str, Enum):
    """Numeric precision of the forward and backward pass."""

    FP32 = "fp32"
    """Full precision everywhere. The reference for equivalence checks."""
    BF16 = "bf16"
    """bfloat16 autocast; fp32 master weights. Works on CPU and on Ampere+ GPUs."""
    FP16 = "fp16"
    """float16 autocast with a dynamic GradScaler. CUDA only."""
    AUTO = "auto"
    """Pick for the device: bf16 on CPU and on GPUs that support it (Ampere+), else fp16."""
    FLOAT8 = "float8"
    """float8 matmuls in the linear layers that gain (torchao), bf16 autocast for the rest.
    GPUs of compute capability 8.9+ (Ada, Hopper, Blackwell); emulated on CPU."""


# ------------------------------------------------------------------------ components


@dataclass(frozen=True)
class Component:
    """User code or a built-in, named by `_target_` (an importable dotted path to a class or
    function) with its arguments, as Hydra's instantiate reads them (`_partial_` and nested
    `_target_` nodes included).

    In the config it is one flat node: `_target_`, the target's arguments, and the few keys
    runner itself reads there (the subclass's own fields, such as `data.num_workers`).
    """

    component: ClassVar[bool] = True
    target: str = ""
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """What error messages call it: the last part of the dotted path."""
        return self.target.rsplit(".", 1)[-1]

    @property
    def node(self) -> dict[str, Any]:
        """What Hydra's instantiate builds: `_target_` and the target's arguments."""
        return {TARGET: self.target, **self.args}


@dataclass(frozen=True)
class ModelSpec(Component):
    """Any `torch.nn.Module`. Arguments named like what the data reports (`num_classes`,
    `input_shape`, `vocab_size`, ...) are filled in from the data unless set here."""

    target: str = "runner.models.builders.mlp"
    channels_last: bool = False  # NHWC memory format on CUDA (convolutional models)


@dataclass(frozen=True)
class DataSpec(Component):
    """A callable returning the train and validation datasets (see runner.data.splits)."""

    target: str = "runner.data.digits.digits"
    num_workers: int = _bound(0, min=0)  # DataLoader worker processes per rank
    drop_last: bool = False  # drop the epoch's last, smaller global batch


@dataclass(frozen=True)
class LossSpec(Component):
    """`loss(outputs, targets) -> (summed loss, item count)` (see runner.train.losses)."""

    target: str = "runner.train.losses.CrossEntropy"


@dataclass(frozen=True)
class MetricSpec(Component):
    """A metric with `update(outputs, targets)`, `compute()`, `reset()`: torchmetrics' shape."""


@dataclass(frozen=True)
class CallbackSpec(Component):
    """An object with some of runner's hooks (runner.callbacks). `ranks`: which ranks call
    it, rank 0 only (main) or every rank (all)."""

    ranks: Literal["main", "all"] = "main"


# ------------------------------------------------------------------------- optimizer


@dataclass(frozen=True)
class OptimizerSpec(Component):
    """Any `torch.optim.Optimizer` class, or a function returning one, given the parameter
    groups first (as torch's optimizers take `params`). runner builds the groups from its own
    keys here: weight-decay exclusions and per-module learning-rate multipliers."""

    target: str = "torch.optim.AdamW"
    # no weight decay for: bias, norm (norm layers), embedding, or a parameter-name pattern
    no_weight_decay: tuple[str, ...] = ()
    norm_weight_decay: float | None = _bound(None, min=0.0)  # for norm layers; None = weight_decay
    lr_multipliers: dict[str, float] | None = None  # name pattern -> x lr; the first match wins

    @property
    def name(self) -> str:
        """`adamw`, `sgd`, `adafactor`: the class's name, lower case."""
        return self.target.rsplit(".", 1)[-1].lower()


# ------------------------------------------------------------------------- scheduler


@dataclass(frozen=True)
class SchedulerSpec(Component):
    """Any `torch.optim.lr_scheduler` class, or a function returning one, given the optimizer
    (and `total_steps`, the steps after warmup, where it takes it). runner warms up linearly
    to the lr where it starts, over `warmup_steps` (or `warmup_epochs`), then steps it."""

    target: str = "runner.engines.schedules.constant"
    warmup_steps: int = _bound(0, min=0)
    warmup_epochs: float | None = _bound(None, min=0.0)  # instead of warmup_steps

    @property
    def name(self) -> str:
        """`constant`, `cosine`, `steplr`: the class's or function's name, lower case."""
        return self.target.rsplit(".", 1)[-1].lower()


# -------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class ElasticLauncherSpec:
    """torch.distributed.elastic: runner's agent starts this node's ranks."""

    name: Literal["elastic"] = "elastic"


@dataclass(frozen=True)
class RayLauncherSpec:
    """Ray Train: the ranks are a TorchTrainer's workers on a Ray cluster."""

    name: Literal["ray"] = "ray"
    address: str | None = None  # null: RAY_ADDRESS, else a local cluster runner starts
    resources_per_worker: dict[str, float] | None = None  # null: 1 CPU (1 GPU under cuda)
    # seconds to wait for room for every worker, at the start and after each restart; null
    # waits as long as it takes (a cluster that scales up)
    start_timeout: float | None = _bound(600.0, gt=0.0)


LauncherSpec = ElasticLauncherSpec | RayLauncherSpec

# ------------------------------------------------------------------ small groups


@dataclass(frozen=True)
class SyncStrategySpec:
    name: SyncStrategy = SyncStrategy.AUTO


@dataclass(frozen=True)
class PrecisionSpec:
    name: Precision = Precision.FP32
    init_scale: float = _bound(2.0**16, gt=0.0)
    growth_interval: int = _bound(2000, min=1)
    # precision=float8 (runner.engines.float8)
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    filter_fqns: tuple[str, ...] = ()  # linear layers whose names hold one of these stay bf16
    auto_filter: bool = True  # torchao's size rule: layers too small to gain stay bf16
    fsdp_float8_all_gather: bool = True  # tensorwise under fsdp: weights gathered in float8


@dataclass(frozen=True)
class CheckpointSpec:
    interval: int | None = _bound(None, min=1)
    keep: int = _bound(2, min=1)
    # written in the background while training goes on (ddp, fsdp); `async` in the YAML
    async_: bool = False
    # each file's content digest in the manifest, checked before a resume
    digest: bool = True


@dataclass(frozen=True)
class InitFromSpec:
    """Pretrained weights the run starts from (runner.models.pretrained): `path` a model.pt,
    a .safetensors file, a sharded safetensors directory with its index, or a local Hugging
    Face model directory; the file's names lose `strip_prefix` and gain `prefix`."""

    path: str | None = None
    strict: bool = True  # missing or unexpected names are an error (else logged)
    prefix: str = ""
    strip_prefix: str = ""


@dataclass(frozen=True)
class TrialSpec:
    """The Optuna trial a job of `hydra/sweeper=runner` is (set by the sweeper, never on the
    command line, and only when the sweep has a pruner): rank 0 reports `sweep.metric` to it
    at every evaluation, and the study's pruner may stop the run there (status `pruned`)."""

    address: str  # where the sweep's process answers reports (host:port; runner.sweeps)
    number: int  # the trial's number: the job's number in the sweep


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep compares runs by: the final value of `metric` that each job returns to
    the sweeper (Optuna), that sweep tables and runner-report put first; `direction` says
    whether larger is better. `auto`: val/accuracy when the run has an accuracy metric,
    else val/loss; minimize a loss, a perplexity or an error, maximize anything else."""

    metric: str = "auto"
    direction: Literal["auto", "maximize", "minimize"] = "auto"
    trial: TrialSpec | None = None


# ------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs to train, resolved and checked by the parent."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    loss: LossSpec = field(default_factory=LossSpec)
    metrics: dict[str, MetricSpec] = field(default_factory=dict)
    callbacks: tuple[CallbackSpec, ...] = ()
    code_dir: tuple[str, ...] = ()  # directories of user code, put on every process's path
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    parallelism: ParallelismSpec = field(default_factory=DDPSpec)
    launcher: LauncherSpec = field(default_factory=ElasticLauncherSpec)
    sync_strategy: SyncStrategySpec = field(default_factory=SyncStrategySpec)
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    logger: TrackersSpec = field(default_factory=lambda: TrackersSpec(TensorBoardTrackerSpec()))
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    watchdog: WatchdogSpec = field(default_factory=WatchdogSpec)
    chaos: ChaosSpec = field(default_factory=ChaosSpec)
    compile: CompileSpec | None = None  # null: eager (the YAML's compile: false|true|{...})
    mfu: MfuSpec = field(default_factory=MfuSpec)
    profile: ProfileSpec = field(default_factory=ProfileSpec)
    loss_spike: LossSpikeSpec = field(default_factory=LossSpikeSpec)
    early_stop: EarlyStopSpec = field(default_factory=EarlyStopSpec)
    init_from: InitFromSpec = field(default_factory=InitFromSpec)
    sweep: SweepSpec = field(default_factory=SweepSpec)
    plan: PlanSpec = field(default_factory=PlanSpec)  # how parallelism=auto chooses

    nproc: int | Literal["auto"] = _bound(1, min=1)
    nodes: int | Literal["auto"] = _bound(1, min=1)
    node_rank: int = _bound(0, min=0)
    master_addr: str = "127.0.0.1"
    master_port: int | None = _bound(None, min=1, max=65535)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # forkserver: ranks are forks of a process that imported torch already (Linux; auto)
    start_method: Literal["auto", "forkserver", "spawn"] = "auto"
    seed: int = _bound(0, min=0)

    global_batch_size: int = _bound(64, min=1)
    grad_accum: int | Literal["auto"] = _bound(1, min=1)  # auto: halve on out-of-memory
    max_steps: int | None = _bound(None, min=1)
    max_epochs: int | None = _bound(None, min=1)
    grad_clip_norm: float | None = _bound(None, gt=0.0)
    # none | full (every block) | selective (every block: attention and the products before it
    # kept, the rest recomputed) | N (every Nth block)
    activation_checkpointing: Literal["none", "full", "selective"] | int = _bound("none", min=1)
    # under compile: the share of the activations the compiler's partitioner may keep (it
    # recomputes the cheapest rest); null: what it keeps by itself
    activation_memory_budget: float | None = _bound(None, gt=0.0, max=1.0)
    # CUDA: the next step's batches copied to the device on a side stream as this one trains
    input_prefetch: bool = True

    log_interval: int = _bound(10, min=1)
    eval_interval: int | None = _bound(None, min=1)
    eval_batches: int | None = _bound(None, min=1)  # evaluate the first N global batches only
    eval_samples: int | None = _bound(None, min=1)  # ... or the first N samples (runner eval)
    eval_ranks: int | None = _bound(None, min=1)  # batches grouped as N data ranks group them
    eval_only: bool = False  # evaluate the starting weights (init_from), write eval.json, stop
    progress_bar: bool = True
    log_grad_norm: bool = True  # the global gradient norm in every log record
    # torch's CUDA sync debug mode on the steps that log nothing (runner.train.step.sync_debug)
    sync_debug: Literal["warn", "error"] | None = None

    resume: str | None = None
    max_restarts: int = _bound(0, min=0)
    nonfinite: Literal["stop", "skip"] = "stop"
    nonfinite_max_skips: int = _bound(5, min=1)

    @property
    def world_size(self) -> int:
        assert isinstance(self.nproc, int), "nproc is resolved before use"
        assert isinstance(self.nodes, int), "nodes is resolved before use"
        return self.nodes * self.nproc

    @property
    def checkpoint_every(self) -> int:
        """Activation checkpointing as 'every Nth block' (0: off, 1: every block)."""
        ac = self.activation_checkpointing
        return {"none": 0, "full": 1, "selective": 1}[ac] if isinstance(ac, str) else ac

    @property
    def eval_limit(self) -> int | None:
        """How many of the validation set's first samples an evaluation reads (eval_samples,
        or eval_batches global batches); None: all of them."""
        if self.eval_samples is not None:
            return self.eval_samples
        return None if self.eval_batches is None else self.eval_batches * self.global_batch_size

    @functools.cached_property
    def grid(self) -> Any:
        """The run's grid at its world size (runner.spec.mesh.Layout), computed once for
        this spec and handed on (a rank computes its own, at the running group's size)."""
        from runner.spec.mesh import layout

        return layout(self)

    @property
    def batch_split(self) -> Any:
        """How a step's global batch is cut (runner.spec.mesh.BatchSplit, rank 0's): what the
        parent checks and DeepSpeed's config say, by the arithmetic every rank uses."""
        from runner.spec.mesh import batch_split

        return batch_split(self, self.grid, 0)

    @property
    def data_world_size(self) -> int:
        """Ranks that read their own part of each batch (runner.spec.mesh): the world size, but
        under tensor parallelism its groups, which each read one."""
        return self.batch_split.data_world

    @property
    def per_rank_batch_size(self) -> int:
        return self.batch_split.per_rank

    @property
    def accum_steps(self) -> int:
        """Microbatches per step to start with (grad_accum=auto starts at one)."""
        return self.batch_split.accum

    @property
    def micro_batch_size(self) -> int:
        return self.batch_split.micro_batch_size
