"""The DeepSpeed config a run spec implies, and the user's `deepspeed_config` merged over it.

Pure data, no DeepSpeed import: the parent checks for conflicts before any rank
starts, and each rank builds the same dict. Batch sizes, precision, optimizer,
scheduler and clipping come from the spec (our optimizer and scheduler are passed
to DeepSpeed as client objects), so a sweep over `parallelism` changes nothing
else. A user key that disagrees with the spec is an error naming both values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from runner.nested import flatten
from runner.spec.schema import DEEPSPEED_SPECS, Precision, RunSpec, Zero3Spec

# Dotted keys the spec owns -> (the spec key to change instead, its value in a spec).
OWNED: dict[str, tuple[str, Callable[[RunSpec], Any]]] = {
    "train_batch_size": ("global_batch_size", lambda s: s.global_batch_size),
    "train_micro_batch_size_per_gpu": (
        "global_batch_size / (world_size x grad_accum)",
        lambda s: s.micro_batch_size,
    ),
    "gradient_accumulation_steps": ("grad_accum", lambda s: s.accum_steps),
    "bf16": ("precision", lambda s: s.precision.name.value),
    "fp16": ("precision", lambda s: s.precision.name.value),
    "optimizer": ("optimizer", lambda s: s.optimizer.name),
    "scheduler": ("scheduler", lambda s: s.scheduler.name),
    "gradient_clipping": ("grad_clip_norm", lambda s: s.grad_clip_norm),
    "zero_optimization.stage": ("parallelism", lambda s: s.parallelism.name),
    "zero_optimization.overlap_comm": (
        "parallelism.overlap_comm",
        lambda s: s.parallelism.overlap_comm,
    ),
    "zero_optimization.contiguous_gradients": (
        "parallelism.contiguous_gradients",
        lambda s: s.parallelism.contiguous_gradients,
    ),
    "zero_optimization.reduce_bucket_size": (
        "parallelism.reduce_bucket_size",
        lambda s: s.parallelism.reduce_bucket_size,
    ),
    "zero_optimization.allgather_bucket_size": (
        "parallelism.allgather_bucket_size",
        lambda s: s.parallelism.allgather_bucket_size,
    ),
    "zero_optimization.offload_optimizer": (
        "parallelism.offload_optimizer",
        lambda s: s.parallelism.offload_optimizer,
    ),
}
# Stage 3's own keys: zero_optimization.<key> -> parallelism.<field>.
for _key, _field in {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "sub_group_size": "sub_group_size",
    "offload_param": "offload_param",
}.items():
    OWNED[f"zero_optimization.{_key}"] = (
        f"parallelism.{_field}",
        lambda s, f=_field: getattr(s.parallelism, f),
    )


def generated_config(spec: RunSpec) -> dict[str, Any]:
    zero = spec.parallelism
    assert isinstance(zero, DEEPSPEED_SPECS)
    precision = spec.precision
    config: dict[str, Any] = {
        "train_batch_size": spec.global_batch_size,
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.accum_steps,
        "zero_optimization": _zero_section(zero),
        # bf16: DeepSpeed skips a step whose gradient norm is not finite only when asked to
        # (fp32 and ZeRO-3 always do); the non-finite guard counts those skips.
        "bf16": {"enabled": True, "check_grad_overflow": True}
        if precision.name is Precision.BF16
        else {"enabled": False},
        "fp16": {"enabled": precision.name is Precision.FP16},
        "zero_allow_untested_optimizer": True,  # our torch optimizers, passed as client objects
        "steps_per_print": 2**31 - 1,  # runner logs its own metrics
        "wall_clock_breakdown": False,
    }
    if precision.name is Precision.FP16:
        config["fp16"].update(
            initial_scale_power=int(math.log2(precision.init_scale)),
            loss_scale_window=precision.growth_interval,
        )
    if zero.offload_optimizer == "cpu" or getattr(zero, "offload_param", "none") == "cpu":
        # Our optimizer is a plain torch one (same numbers as ddp), not DeepSpeedCPUAdam.
        config["zero_force_ds_cpu_optimizer"] = False
    # Explicit even when off: DeepSpeed 0.19 clips at 1.0 by default, which silently
    # changed steps with a large gradient (caught by the equivalence tests).
    config["gradient_clipping"] = spec.grad_clip_norm if spec.grad_clip_norm is not None else 0.0
    return config


def _zero_section(zero: Any) -> dict[str, Any]:
    section: dict[str, Any] = {
        "stage": zero.stage,
        "overlap_comm": zero.overlap_comm,
        "contiguous_gradients": zero.contiguous_gradients,
        "reduce_bucket_size": zero.reduce_bucket_size,
    }
    if isinstance(zero, Zero3Spec):
        section.update(
            stage3_prefetch_bucket_size=zero.prefetch_bucket_size,
            stage3_param_persistence_threshold=zero.param_persistence_threshold,
            stage3_max_live_parameters=zero.max_live_parameters,
            stage3_max_reuse_distance=zero.max_reuse_distance,
            sub_group_size=zero.sub_group_size,
        )
        if zero.offload_param == "cpu":
            section["offload_param"] = {"device": "cpu"}
    else:
        section["allgather_bucket_size"] = zero.allgather_bucket_size
    if zero.offload_optimizer == "cpu":
        section["offload_optimizer"] = {"device": "cpu"}
    return section


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        child = data.get(key)
        if not isinstance(child, dict):
            child = data[key] = {}
        data = child
    data[leaf] = value


def _owner(path: str) -> tuple[str, Callable[[RunSpec], Any]] | None:
    for key, owner in OWNED.items():
        if path == key or path.startswith(key + "."):
            return owner
    return None


def merge_user_config(spec: RunSpec) -> tuple[dict[str, Any], list[str]]:
    """The generated config with `parallelism.deepspeed_config` merged over it.

    Returns (config, problems); a problem names the user's key and value and the
    spec key and value it contradicts.
    """
    zero = spec.parallelism
    assert isinstance(zero, DEEPSPEED_SPECS)
    config = generated_config(spec)
    ours = flatten(config)
    problems = []
    for path, value in flatten(zero.deepspeed_config).items():
        owner = _owner(path)
        mine = ours.get(path)
        if owner is not None and mine != value:
            key, getter = owner
            effect = "runner sets this itself" if mine is None else f"which gives {mine!r}"
            problems.append(
                f"parallelism.deepspeed_config.{path}={value!r}: conflicts with "
                f"{key}={getter(spec)!r} ({effect}); change {key} instead"
            )
            continue
        _set(config, path, value)
    return config, problems
