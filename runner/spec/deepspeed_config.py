"""The DeepSpeed config a run spec implies, and the user's `deepspeed_config` merged over it.

Pure data, no DeepSpeed import: the parent checks for conflicts before any rank
starts, and each rank builds the same dict. Batch sizes, precision, optimizer,
scheduler and clipping come from the spec (our optimizer and scheduler are passed
to DeepSpeed as client objects), so a sweep over `parallelism` changes nothing
else. A user key that disagrees with the spec is an error naming both values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runner.spec.convert import flatten
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
    "torch_autocast": ("precision", lambda s: s.precision.name.value),
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
        **_precision_sections(precision.name),
        "zero_allow_untested_optimizer": True,  # our torch optimizers, passed as client objects
        "steps_per_print": 2**31 - 1,  # runner logs its own metrics
        "wall_clock_breakdown": False,
    }
    if zero.offload_optimizer == "cpu" or getattr(zero, "offload_param", "none") == "cpu":
        # Our optimizer is a plain torch one (same numbers as ddp), not DeepSpeedCPUAdam.
        config["zero_force_ds_cpu_optimizer"] = False
    # Explicit even when off: DeepSpeed 0.19 clips at 1.0 by default, which silently
    # changed steps with a large gradient (caught by the equivalence tests).
    config["gradient_clipping"] = spec.grad_clip_norm if spec.grad_clip_norm is not None else 0.0
    return config


def _precision_sections(precision: Precision) -> dict[str, Any]:
    """bf16 and fp16 mean under ZeRO what they mean under ddp and fsdp: the weights, their
    gradients, the reduction of those and the optimizer stay fp32, and the forward pass runs
    under torch.autocast (DeepSpeed's `torch_autocast` section, for every module: no
    gradient is reduced in 16 bits). DeepSpeed's own bf16/fp16 sections would keep the
    weights themselves in 16 bits, and its engine switches off an enclosing autocast unless
    this section is on: fp32 inputs then met bf16 weights on a GPU. fp16's loss scale is
    runner's (runner.engines.deepspeed.LossScale), handed to ZeRO, which unscales, clips and
    skips an overflowing step with it."""
    sections: dict[str, Any] = {"bf16": {"enabled": False}, "fp16": {"enabled": False}}
    if precision is not Precision.FP32:
        sections["torch_autocast"] = {
            "enabled": True,
            "dtype": "bfloat16" if precision is Precision.BF16 else "float16",
            "lower_precision_safe_modules": [],
        }
    return sections


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
            if key == "precision":
                effect = (
                    "runner keeps fp32 weights under ZeRO and runs the forward pass under "
                    "torch.autocast, through DeepSpeed's torch_autocast section"
                )
            problems.append(
                f"parallelism.deepspeed_config.{path}={value!r}: conflicts with "
                f"{key}={getter(spec)!r} ({effect}); change {key} instead"
            )
            continue
        _set(config, path, value)
    return config, problems
