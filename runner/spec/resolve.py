"""Resolve a composed config into a checked `RunSpec`: stage 2 of a run.

Everything a user can get wrong is caught here, in the parent, before any rank
starts: types and bounds (via the schema), then the checks between fields and
against this machine. `auto` values are replaced by what they resolve to, so
the spec written to the run directory says what actually ran.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from runner import hardware
from runner.components import TARGET
from runner.processes import can_fork_ranks
from runner.secrets import Secrets, restore
from runner.spec.convert import SpecError, from_dict, to_dict
from runner.spec.data_paths import resolve_data_paths
from runner.spec.schema import (
    DEEPSPEED_SPECS,
    FSDPSpec,
    Precision,
    RunSpec,
    SweepSpec,
    SyncStrategy,
)

CONFIG_FILE = "config.yaml"


def resolve_spec(
    config: Mapping[str, Any],
    cuda_devices: int | None = None,
    run_dir: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> RunSpec:
    """Check `config` (plain data, interpolations resolved) and resolve its `auto` values.

    `run_dir` is where the run will write (resume=auto reads its checkpoints); `environ`
    (default os.environ) is where nodes=auto looks for a SLURM allocation.
    Raises SpecError listing every problem found.
    """
    spec = from_dict(RunSpec, _migrate(config))
    problems: list[str] = []
    spec = _resolve_nodes(spec, problems, os.environ if environ is None else environ)
    spec = _resolve_hardware(spec, problems, cuda_devices)
    spec = resolve_data_paths(spec, problems)
    spec = _resolve_code_dirs(spec, problems)
    spec = _resolve_init_from(spec, problems)
    spec = _resolve_trackers(spec)
    if problems:  # the checks below need a resolved nproc and device
        raise SpecError(problems)
    spec = _resolve_replicate(spec, problems)
    _check_sizes(spec, problems)
    _check_optimizer(spec, problems)
    _check_cluster(spec, problems)
    _check_run_control(spec, problems)
    _check_sync_strategy(spec, problems)
    _check_shm_allreduce(spec, problems)
    _check_auto_microbatching(spec, problems)
    _check_compile(spec, problems)
    _check_deepspeed(spec, problems)
    _check_loggers(spec, problems)
    _check_mfu(spec, problems)
    _check_async_checkpoints(spec, problems)
    _check_resume(spec, problems, Path(run_dir) if run_dir is not None else None)
    spec = _resolve_sweep(spec, problems)
    if problems:
        raise SpecError(problems)
    if spec.sync_strategy.name is SyncStrategy.AUTO and not spec.parallelism.syncs_gradients_itself:
        if getattr(spec.parallelism, "find_unused_parameters", False):
            chosen = SyncStrategy.MULTI_AUTO_SYNC
        else:
            chosen = SyncStrategy.SINGLE_AUTO_SYNC
        spec = dataclasses.replace(
            spec, sync_strategy=dataclasses.replace(spec.sync_strategy, name=chosen)
        )
    return spec


def _resolve_hardware(spec: RunSpec, problems: list[str], cuda_devices: int | None) -> RunSpec:
    needs_cuda_probe = spec.device in ("auto", "cuda")
    gpus = (
        cuda_devices
        if cuda_devices is not None
        else (hardware.cuda_device_count() if needs_cuda_probe else 0)
    )
    device = spec.device
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    elif device == "cuda" and gpus == 0:
        problems.append(
            "device='cuda': no CUDA device is visible on this machine; valid here: auto, cpu"
        )
    nproc = spec.nproc
    if nproc == "auto":
        nproc = gpus if device == "cuda" and gpus > 0 else hardware.cpu_cores()
    elif device == "cuda" and 0 < gpus < nproc:
        problems.append(
            f"nproc={nproc}: only {gpus} CUDA device(s) visible; use nproc<={gpus} or nproc=auto"
        )
    precision = spec.precision
    if precision.name is Precision.AUTO:
        capabilities = hardware.cuda_compute_capabilities() if device == "cuda" else []
        cpu_bf16 = device != "cuda" and hardware.cpu_has_native_bf16()
        chosen = Precision(hardware.auto_precision(device, capabilities, cpu_bf16))
        precision = dataclasses.replace(precision, name=chosen)
    if precision.name is Precision.FP16 and device != "cuda":
        problems.append(
            f"precision=fp16 needs CUDA (GradScaler), but device={device}; "
            "use precision=bf16 or fp32 on CPU"
        )
    start_method = spec.start_method
    if start_method == "auto":
        start_method = "forkserver" if can_fork_ranks() else "spawn"
    elif start_method == "forkserver" and not can_fork_ranks():
        problems.append(
            f"start_method=forkserver: forking ranks is safe only on Linux, not {sys.platform}; "
            "valid here: auto, spawn"
        )
    return dataclasses.replace(
        spec, device=device, nproc=nproc, precision=precision, start_method=start_method
    )


def _resolve_nodes(spec: RunSpec, problems: list[str], environ: Mapping[str, str]) -> RunSpec:
    """nodes=auto: the SLURM allocation or the Kubeflow job (TrainJob, PyTorchJob) this runs
    in (nodes, node_rank, master; and nproc=auto, where the job says how many processes a
    node runs), else 1 node."""
    if spec.nodes != "auto":
        return spec
    from runner.spec import kubernetes, slurm

    place = None
    for where, module in (("SLURM", slurm), ("Kubeflow", kubernetes)):
        try:
            place = module.placement(environ, spec.master_port)
        except ValueError as exc:
            problems.append(f"nodes=auto: cannot read the {where} environment: {exc}")
            return dataclasses.replace(spec, nodes=1)
        if place is not None:
            break
    if place is None:
        return dataclasses.replace(spec, nodes=1)
    nproc = place.nproc if spec.nproc == "auto" and place.nproc is not None else spec.nproc
    return dataclasses.replace(
        spec,
        nodes=place.nodes,
        node_rank=place.node_rank,
        master_addr=place.master_addr,
        master_port=place.master_port,
        nproc=nproc,
    )


def _resolve_replicate(spec: RunSpec, problems: list[str]) -> RunSpec:
    """fsdp's replicate=null: a copy per node (HSDP across nodes; plain FSDP on one)."""
    options = spec.parallelism
    if not isinstance(options, FSDPSpec):
        return spec
    replicate = spec.nodes if options.replicate is None else options.replicate
    world = spec.world_size
    if world % replicate:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        problems.append(
            f"parallelism.replicate={replicate}: must divide the world size nproc x nodes = "
            f"{world}; valid: {divisors}"
        )
    parallelism = dataclasses.replace(options, replicate=replicate)
    return dataclasses.replace(spec, parallelism=parallelism)


def _resolve_code_dirs(spec: RunSpec, problems: list[str]) -> RunSpec:
    resolved = []
    for directory in spec.code_dir:
        path = Path(directory).expanduser().resolve()
        if not path.is_dir():
            problems.append(f"code_dir={directory!r}: directory does not exist")
        resolved.append(str(path))
    return dataclasses.replace(spec, code_dir=tuple(resolved))


def _resolve_init_from(spec: RunSpec, problems: list[str]) -> RunSpec:
    """init_from.path made absolute, so every node and rank reads the same file; what it
    holds is checked by the agent, which can read it (runner.launch.preflight)."""
    given = spec.init_from.path
    if given is None:
        return spec
    path = Path(given).expanduser().resolve()
    if not path.exists():
        problems.append(
            f"init_from.path={given!r}: no such file or directory; give a model.pt, a "
            ".safetensors file, a sharded safetensors directory, a Hugging Face model "
            "directory (local: runner downloads nothing), a run directory or a checkpoint"
        )
    return dataclasses.replace(spec, init_from=dataclasses.replace(spec.init_from, path=str(path)))


MINIMIZED = ("loss", "perplexity", "error")  # a metric named so is better smaller


def _resolve_sweep(spec: RunSpec, problems: list[str]) -> RunSpec:
    """sweep.metric and sweep.direction made concrete, the metric one this run reports."""
    reported = ["val/loss", *(f"val/{name}" for name in spec.metrics), "train/loss"]
    metric = spec.sweep.metric
    if metric == "auto":
        metric = "val/accuracy" if "accuracy" in spec.metrics else "val/loss"
    elif metric not in reported:
        problems.append(
            f"sweep.metric={metric!r}: not a value this run reports; valid: auto, "
            + ", ".join(reported)
        )
    direction = spec.sweep.direction
    if direction == "auto":
        smaller = metric.rsplit("/", 1)[-1].endswith(MINIMIZED)
        direction = "minimize" if smaller else "maximize"
    return dataclasses.replace(spec, sweep=SweepSpec(metric=metric, direction=direction))


def _check_sizes(spec: RunSpec, problems: list[str]) -> None:
    per_step = spec.world_size * spec.accum_steps
    if spec.global_batch_size % per_step:
        problems.append(
            f"global_batch_size={spec.global_batch_size}: not divisible by "
            f"world_size x grad_accum = {spec.world_size} x {spec.accum_steps} = {per_step}; "
            f"pick a multiple of {per_step}"
        )
    if spec.max_steps is None and spec.max_epochs is None:
        problems.append("max_steps=null and max_epochs=null: set at least one of them")
    warmup = spec.scheduler
    if warmup.warmup_epochs is not None and warmup.warmup_steps:
        problems.append(
            f"scheduler.warmup_epochs={warmup.warmup_epochs}: scheduler.warmup_steps="
            f"{warmup.warmup_steps} is set too; set one of them (scheduler.warmup_steps=0)"
        )


def _check_optimizer(spec: RunSpec, problems: list[str]) -> None:
    """What runner reads of the optimizer node: the lr and its own keys. The rest binds to
    the optimizer's signature in the agent's check."""
    optimizer = spec.optimizer
    lr = optimizer.args.get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float) or lr <= 0):
        problems.append(f"optimizer.lr={lr!r}: must be > 0")
    for pattern, multiplier in (optimizer.lr_multipliers or {}).items():
        if (
            isinstance(multiplier, bool)
            or not isinstance(multiplier, int | float)
            or multiplier < 0
        ):
            problems.append(
                f"optimizer.lr_multipliers.{pattern}={multiplier!r}: expected a number >= 0"
            )
    if "norm" in optimizer.no_weight_decay and optimizer.norm_weight_decay is not None:
        problems.append(
            f"optimizer.norm_weight_decay={optimizer.norm_weight_decay}: optimizer.no_weight_decay "
            "has norm too; set one of them"
        )


def _check_sync_strategy(spec: RunSpec, problems: list[str]) -> None:
    strategy = spec.sync_strategy.name
    if spec.parallelism.syncs_gradients_itself and strategy is not SyncStrategy.AUTO:
        problems.append(
            f"sync_strategy={strategy.value}: parallelism={spec.parallelism.name} reduces "
            "gradients itself; sync strategies apply to ddp only, use sync_strategy=auto"
        )


def _check_shm_allreduce(spec: RunSpec, problems: list[str]) -> None:
    """ddp's shm_allreduce=true where shared memory cannot carry the all-reduce."""
    if getattr(spec.parallelism, "shm_allreduce", None) is not True:
        return
    obstacle = hardware.shared_memory_obstacle(spec.device, spec.nodes)
    if obstacle is not None:
        problems.append(
            f"parallelism.shm_allreduce=true: not possible with {obstacle}; "
            "valid here: null (use it where it applies) or false"
        )


def _check_auto_microbatching(spec: RunSpec, problems: list[str]) -> None:
    """grad_accum=auto retries a microbatch whose forward pass ran out of memory, so no rank
    may have started exchanging that microbatch's gradients; zero3 gathers weights inside
    DeepSpeed's forward hooks, where a rank that ran out cannot agree with the others."""
    if spec.grad_accum == "auto" and spec.parallelism.name == "zero3":
        problems.append(
            "grad_accum=auto: parallelism=zero3 is not supported (its forward pass gathers "
            "weights in DeepSpeed's own hooks, where a rank that ran out of memory cannot "
            "agree with the others); use a fixed grad_accum, or ddp, zero1, zero2, fsdp"
        )


def _check_compile(spec: RunSpec, problems: list[str]) -> None:
    options = spec.compile
    if options is None:
        return
    bucket_mb = getattr(spec.parallelism, "bucket_cap_mb", None)
    if bucket_mb is not None and bucket_mb < 1:
        problems.append(
            f"parallelism.bucket_cap_mb={bucket_mb:g}: with compile, dynamo's DDP optimizer "
            "needs buckets of at least DDP's first one (1 MB); use bucket_cap_mb>=1, or "
            "compile=false"
        )
    if spec.device == "cpu" and options.backend == "inductor":
        compiler = os.environ.get("CXX") or "g++"  # what inductor's CPU backend runs
        if shutil.which(compiler) is None:
            problems.append(
                f"compile.backend=inductor: on CPU it builds C++ kernels with {compiler}, "
                "which is not on PATH; install a C++ compiler (Debian/Ubuntu: apt-get install "
                "g++; or set CXX), or use compile.backend=aot_eager"
            )


def _check_deepspeed(spec: RunSpec, problems: list[str]) -> None:
    if not isinstance(spec.parallelism, DEEPSPEED_SPECS):
        return
    if importlib.util.find_spec("deepspeed") is None:
        problems.append(
            f"parallelism={spec.parallelism.name}: needs DeepSpeed, which is not installed "
            "(make install installs it; or pip install deepspeed)"
        )
    from runner.spec.deepspeed_config import merge_user_config

    problems.extend(merge_user_config(spec)[1])


# logger option -> (module it imports, the extra that installs it)
LOGGER_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
MLFLOW_DEFAULT_STORE = Path("runs") / "mlflow.db"  # under the launch directory


def _resolve_trackers(spec: RunSpec) -> RunSpec:
    """logger.mlflow.tracking_uri=null: a SQLite store under the launch directory's runs/
    (absolute, so config.yaml names the store a rerun or resume goes on writing to)."""
    mlflow = spec.logger.mlflow
    if mlflow is None or mlflow.tracking_uri is not None:
        return spec
    uri = f"sqlite:///{Path.cwd() / MLFLOW_DEFAULT_STORE}"
    logger = dataclasses.replace(spec.logger, mlflow=dataclasses.replace(mlflow, tracking_uri=uri))
    return dataclasses.replace(spec, logger=logger)


def _check_loggers(spec: RunSpec, problems: list[str]) -> None:
    for name in spec.logger.selected:
        module, extra = LOGGER_PACKAGES.get(name, (None, None))
        if module and importlib.util.find_spec(module) is None:
            problems.append(
                f"logger={name}: needs the {module} package, which is not installed "
                f"(pip install 'runner[{extra}]')"
            )


def _check_async_checkpoints(spec: RunSpec, problems: list[str]) -> None:
    name = spec.parallelism.name
    if spec.checkpoint.async_ and name not in ("ddp", "fsdp"):
        problems.append(
            f"checkpoint.async=true: parallelism={name} writes its checkpoints through "
            "DeepSpeed, which cannot write in the background; valid with ddp and fsdp, or "
            "checkpoint.async=false"
        )


def _check_mfu(spec: RunSpec, problems: list[str]) -> None:
    gpu = spec.mfu.gpu
    if gpu is not None and spec.mfu.peak_tflops is None:
        row = hardware.gpu_row(gpu)
        if row is None:
            problems.append(
                f"mfu.gpu={gpu!r}: not a GPU runner knows the peak of; known: "
                f"{', '.join(hardware.PEAK_TFLOPS)} (or set mfu.peak_tflops)"
            )
        elif spec.precision.name.value not in hardware.PEAK_TFLOPS[row]:
            problems.append(
                f"mfu.gpu={gpu!r}: {row} has no {spec.precision.name.value} peak in runner's "
                f"table; set mfu.peak_tflops"
            )


def _check_cluster(spec: RunSpec, problems: list[str]) -> None:
    if spec.launcher.name == "ray":
        _check_ray(spec, problems)
        return
    if spec.node_rank >= spec.nodes:
        problems.append(
            f"node_rank={spec.node_rank}: must be in 0..{spec.nodes - 1} for nodes={spec.nodes}"
        )
    if spec.nodes > 1 and spec.master_port is None:
        problems.append(
            f"master_port=null: nodes={spec.nodes} needs a fixed port all nodes agree on"
        )
    if not spec.master_addr.strip():
        problems.append("master_addr='': must be a host name or IP address")


def _check_ray(spec: RunSpec, problems: list[str]) -> None:
    """One runner drives a Ray run: Ray places its nodes x nproc workers."""
    if importlib.util.find_spec("ray") is None:
        problems.append(
            "launcher=ray: Ray is not installed here; pip install 'runner[ray]' "
            "(or launcher=elastic)"
        )
    if spec.node_rank != 0:
        problems.append(
            f"node_rank={spec.node_rank}: under launcher=ray one runner starts every worker; "
            "start it once, with node_rank=0"
        )


def _check_run_control(spec: RunSpec, problems: list[str]) -> None:
    chaos = spec.chaos
    if (chaos.kill_rank is None) != (chaos.at_step is None):
        problems.append(
            f"chaos.kill_rank={chaos.kill_rank}, chaos.at_step={chaos.at_step}: set both or neither"
        )
    elif chaos.kill_rank is not None and chaos.kill_rank >= spec.world_size:
        problems.append(
            f"chaos.kill_rank={chaos.kill_rank}: must be a rank in 0..{spec.world_size - 1}"
        )


def _check_resume(spec: RunSpec, problems: list[str], run_dir: Path | None) -> None:
    """Find the checkpoint this run starts from and check that it fits the spec."""
    from runner.rundir.checkpoints import CheckpointStore, resolve_checkpoint_path
    from runner.spec.resume_check import check_resume

    own = CheckpointStore(run_dir / "checkpoints", keep=1).latest() if run_dir else None
    if spec.resume is None:
        if own is not None:
            problems.append(
                f"resume=null: the run directory {run_dir} already holds a run (checkpoint "
                f"{own.name}); use resume=auto to continue it, or another hydra.run.dir"
            )
        return
    if spec.resume == "auto":
        checkpoint = own  # none yet: a fresh start
    elif not os.path.exists(spec.resume):
        problems.append(
            f"resume={spec.resume!r}: no such file or directory; use null, auto or a PATH"
        )
        return
    else:
        checkpoint = resolve_checkpoint_path(Path(spec.resume))
        if checkpoint is None:
            problems.append(
                f"resume={spec.resume!r}: holds no complete checkpoint (a checkpoints/step_N "
                "directory, or a run directory with checkpoints/)"
            )
            return
    if checkpoint is not None and not problems:  # comparing needs an otherwise valid spec
        problems.extend(check_resume(spec, checkpoint))


def save_spec(spec: RunSpec, run_dir: str | Path, secrets: Secrets | None = None) -> Path:
    """Write the resolved spec as `config.yaml` (atomically) and return its path; `secrets`:
    what stays a placeholder or is masked there (runner.secrets)."""
    path = Path(run_dir) / CONFIG_FILE
    tmp = path.with_suffix(".yaml.tmp")
    config = to_dict(spec)
    tmp.write_text(yaml.safe_dump(secrets.written(config) if secrets else config, sort_keys=False))
    os.replace(tmp, path)
    return path


def load_spec(run_dir: str | Path) -> RunSpec:
    """Read the resolved spec of a run directory (what every rank does first): its
    placeholders resolved from this process's environment, its masked secrets from what
    the parent handed down."""
    return from_dict(RunSpec, _migrate(restore(written_config(run_dir), os.environ)))


def written_config(run_dir: str | Path) -> dict[str, Any]:
    """config.yaml as written: what may be logged (placeholders, masked secrets)."""
    return yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text())


OLD_OPTIONS = {
    "optimizer": {"adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"},
    "scheduler": {
        "constant": "runner.engines.schedules.constant",
        "cosine": "runner.engines.schedules.cosine",
    },
}


def _migrate(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """`compile: true|false` as the optional section it stands for; configs of older runs:
    `tensorboard: true|false` became the logger group; optimizers and schedulers named by
    `name` became components."""
    migrated = dict(config)
    if isinstance(migrated.get("compile"), bool):
        migrated["compile"] = {} if migrated["compile"] else None
    for group, targets in OLD_OPTIONS.items():  # optimizer and scheduler by `name`
        node = migrated.get(group)
        if isinstance(node, Mapping) and node.get("name") in targets:
            node = dict(node)
            migrated[group] = {TARGET: targets[node.pop("name")], **node}
    if "tensorboard" in config and "logger" not in config:
        tensorboard = migrated.pop("tensorboard")
        migrated["logger"] = {"tensorboard": {}} if tensorboard else {}
    return migrated
