"""Resolve a composed config into a checked `RunSpec`: stage 2 of a run.

Everything a user can get wrong is caught here, in the parent, before any rank
starts: types and bounds (via the schema), then the checks between fields and
against this machine (runner.spec.checks). `auto` values are replaced by what they resolve to, so
the spec written to the run directory says what actually ran.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner import hardware
from runner.processes import can_fork_ranks
from runner.spec.checks import check_spec
from runner.spec.config_file import migrate
from runner.spec.convert import SpecError, from_dict
from runner.spec.data_paths import resolve_data_paths
from runner.spec.mesh import layout_problems
from runner.spec.schema import (
    DDPSpec,
    FSDPSpec,
    Precision,
    RunSpec,
    SyncStrategy,
)


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
    spec = from_dict(RunSpec, migrate(config))
    problems: list[str] = []
    spec = _resolve_nodes(spec, problems, os.environ if environ is None else environ)
    spec = _resolve_hardware(spec, problems, cuda_devices)
    spec = resolve_data_paths(spec, problems)
    spec = _resolve_code_dirs(spec, problems)
    spec = _resolve_init_from(spec, problems)
    spec = _resolve_trackers(spec)
    if problems:  # the checks below need a resolved nproc and device
        raise SpecError(problems)
    spec = _resolve_replicate(spec)
    problems.extend(layout_problems(spec))
    check_spec(spec, problems, Path(run_dir) if run_dir is not None else None)
    spec = _resolve_sweep(spec, problems)
    spec = _resolve_early_stop(spec, problems)
    if problems:
        raise SpecError(problems)
    if spec.sync_strategy.name is SyncStrategy.AUTO and not spec.parallelism.syncs_gradients_itself:
        if isinstance(spec.parallelism, DDPSpec) and spec.parallelism.find_unused_parameters:
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


def _resolve_replicate(spec: RunSpec) -> RunSpec:
    """fsdp's replicate=null: a copy per node (HSDP across nodes; plain FSDP on one)."""
    options = spec.parallelism
    if not isinstance(options, FSDPSpec) or options.replicate is not None:
        return spec
    parallelism = dataclasses.replace(options, replicate=spec.nodes)
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
    sweep = dataclasses.replace(spec.sweep, metric=metric, direction=direction)
    return dataclasses.replace(spec, sweep=sweep)


def _resolve_early_stop(spec: RunSpec, problems: list[str]) -> RunSpec:
    """early_stop.metric and .mode made concrete (after sweep.*): an evaluation's value."""
    early = spec.early_stop
    evaluated = ["val/loss", *(f"val/{name}" for name in spec.metrics)]
    metric = spec.sweep.metric if early.metric == "auto" else early.metric
    if (early.patience is not None or early.metric != "auto") and metric not in evaluated:
        given = f"early_stop.metric={early.metric!r}"
        problems.append(
            f"{given}: not a value this run evaluates; valid: auto, " + ", ".join(evaluated)
        )
    mode = early.mode
    if mode == "auto":
        mode = "min" if metric.rsplit("/", 1)[-1].endswith(MINIMIZED) else "max"
    return dataclasses.replace(
        spec, early_stop=dataclasses.replace(early, metric=metric, mode=mode)
    )


# logger option -> (module it imports, the extra that installs it)
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
