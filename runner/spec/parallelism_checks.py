"""The checks of the chosen parallelism, between its keys and the rest of the spec (part of
check_spec, runner.spec.checks): its sync strategy, ddp's shared-memory all-reduce, what a
pipeline schedule, context and expert groups need of the mesh and the loss, DeepSpeed's
config, and which engines write checkpoints in the background."""

from __future__ import annotations

import importlib.util

from runner import hardware
from runner.spec.parallelism_specs import ONE_STAGE_PER_RANK, DDPSpec
from runner.spec.schema import DEEPSPEED_SPECS, RunSpec, SyncStrategy


def _yaml(value: object) -> str:
    """A value as it is typed on the command line (true, null, 3)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return str(value)


def check_sync_strategy(spec: RunSpec, problems: list[str]) -> None:
    strategy = spec.sync_strategy.name
    if spec.parallelism.syncs_gradients_itself and strategy is not SyncStrategy.AUTO:
        problems.append(
            f"sync_strategy={strategy.value}: parallelism={spec.parallelism.name} reduces "
            "gradients itself; sync strategies apply to ddp only, use sync_strategy=auto"
        )


def check_shm_allreduce(spec: RunSpec, problems: list[str]) -> None:
    """ddp's shm_allreduce=true where shared memory cannot carry the all-reduce."""
    if not isinstance(spec.parallelism, DDPSpec) or spec.parallelism.shm_allreduce is not True:
        return
    obstacle = hardware.shared_memory_obstacle(spec.device, spec.nodes)
    if obstacle is not None:
        problems.append(
            f"parallelism.shm_allreduce=true: not possible with {obstacle}; "
            "valid here: null (use it where it applies) or false"
        )


def check_auto_microbatching(spec: RunSpec, problems: list[str]) -> None:
    """grad_accum=auto retries a microbatch whose forward pass ran out of memory, so no rank
    may have started exchanging that microbatch's gradients; zero3 gathers weights inside
    DeepSpeed's forward hooks, where a rank that ran out cannot agree with the others."""
    if spec.grad_accum == "auto" and spec.parallelism.name == "zero3":
        problems.append(
            "grad_accum=auto: parallelism=zero3 is not supported (its forward pass gathers "
            "weights in DeepSpeed's own hooks, where a rank that ran out of memory cannot "
            "agree with the others); use a fixed grad_accum, or ddp, zero1, zero2, fsdp"
        )


def check_pipeline(spec: RunSpec, problems: list[str]) -> None:
    """What a pipeline schedule needs of the step's microbatches, which are its own."""
    options = spec.parallelism
    pipeline = options.pipeline
    if pipeline == 1:
        return
    schedule, each = options.pipeline_schedule, options.stages_each
    key = f"parallelism.pipeline_schedule={schedule}"
    if spec.grad_accum == "auto":
        problems.append(
            "grad_accum=auto: not with parallelism.pipeline (the pipeline's microbatches are "
            "the step's, fixed when its schedule is built); give a number"
        )
        return
    if schedule in ONE_STAGE_PER_RANK and each != 1:
        problems.append(f"parallelism.stages_per_rank={each}: {key} runs one stage per rank")
    accum, stages = spec.grad_accum, pipeline * each
    rounds = max(1, accum // pipeline)  # torch's interleaved rounds: a multiple of P divides
    needs = {
        "1f1b": (accum >= stages, f"at least {stages} (one per stage)"),
        "interleaved_1f1b": (accum % rounds == 0, f"a multiple of its rounds ({rounds})"),
    }
    fits, valid = needs.get(schedule, (True, ""))
    if not fits and not spec.eval_only:  # an evaluation relays batches, no schedule
        problems.append(f"grad_accum={accum}: {key} needs {valid} microbatches per step")
    data = spec.data.args
    ragged = {k: data[k] for k in ("pack", "min_length") if k in data}
    if ragged.get("pack") is False or ragged.get("min_length") is not None:
        given = " ".join(f"data.{k}={_yaml(v)}" for k, v in ragged.items())
        problems.append(
            f"{given}: samples of many lengths, and a pipeline's stages pass activations of "
            f"one shape (parallelism.pipeline={pipeline}); use data.pack=true "
            "data.min_length=null"
        )
    if spec.compile is not None and spec.compile.per_block is False:
        problems.append(
            "compile.per_block=false: under parallelism.pipeline each stage runs its own "
            "layers, never the whole model's forward; compile per block (compile=true)"
        )


def check_context(spec: RunSpec, problems: list[str]) -> None:
    """Context parallelism gives each rank the loss of its positions: a next-token loss."""
    context = spec.parallelism.context
    if context == 1:
        return
    if not spec.loss.target.endswith("CausalLM"):
        problems.append(
            f"parallelism.context={context}: loss._target_={spec.loss.target} cannot be split "
            "by position; context parallelism needs loss=causal_lm"
        )


def check_deepspeed(spec: RunSpec, problems: list[str]) -> None:
    if not isinstance(spec.parallelism, DEEPSPEED_SPECS):
        return
    if importlib.util.find_spec("deepspeed") is None:
        problems.append(
            f"parallelism={spec.parallelism.name}: needs DeepSpeed, which is not installed "
            "(make install installs it; or pip install deepspeed)"
        )
    from runner.spec.deepspeed_config import merge_user_config

    problems.extend(merge_user_config(spec)[1])


def check_async_checkpoints(spec: RunSpec, problems: list[str]) -> None:
    name = spec.parallelism.name
    if spec.checkpoint.async_ and name not in ("ddp", "fsdp"):
        problems.append(
            f"checkpoint.async=true: parallelism={name} writes its checkpoints through "
            "DeepSpeed, which cannot write in the background; valid with ddp and fsdp, or "
            "checkpoint.async=false"
        )
