"""The checks between a spec's fields, and against this machine, that resolving runs once
every `auto` is resolved (runner.spec.resolve): each adds the problems it finds, naming the
key, the value and what would be valid, so that every one is reported at once, before any
rank starts."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from runner import hardware
from runner.spec.device_checks import check_compile, check_float8, check_profile
from runner.spec.mesh import layout
from runner.spec.parallelism_specs import ONE_STAGE_PER_RANK, DDPSpec
from runner.spec.plan_specs import bare_number, parse_size
from runner.spec.schema import (
    DEEPSPEED_SPECS,
    RunSpec,
    SyncStrategy,
)


def check_spec(spec: RunSpec, problems: list[str], run_dir: Path | None) -> None:
    """Every check, in this order (the order problems are listed in)."""
    _check_sizes(spec, problems)
    _check_optimizer(spec, problems)
    _check_cluster(spec, problems)
    _check_run_control(spec, problems)
    _check_sync_strategy(spec, problems)
    _check_shm_allreduce(spec, problems)
    _check_auto_microbatching(spec, problems)
    _check_pipeline(spec, problems)
    _check_context(spec, problems)
    _check_expert(spec, problems)
    check_compile(spec, problems)
    check_float8(spec, problems)
    check_profile(spec, problems)
    _check_deepspeed(spec, problems)
    _check_trackers(spec, problems)
    _check_mfu(spec, problems)
    _check_async_checkpoints(spec, problems)
    _check_plan(spec, problems)
    _check_resume(spec, problems, run_dir)


def _yaml(value: object) -> str:
    """A value as it is typed on the command line (true, null, 3)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return str(value)


def _check_sizes(spec: RunSpec, problems: list[str]) -> None:
    data_ranks = spec.data_world_size
    per_step = data_ranks * spec.accum_steps
    if spec.global_batch_size % per_step:
        ranks = "world_size" if data_ranks == spec.world_size else "data ranks (world / tensor)"
        problems.append(
            f"global_batch_size={spec.global_batch_size}: not divisible by "
            f"{ranks} x grad_accum = {data_ranks} x {spec.accum_steps} = {per_step}; "
            f"pick a multiple of {per_step}"
        )
    if spec.max_steps is None and spec.max_epochs is None:
        problems.append("max_steps=null and max_epochs=null: set at least one of them")
    if spec.eval_samples is not None and spec.eval_batches is not None:
        problems.append(
            f"eval_samples={spec.eval_samples}: eval_batches={spec.eval_batches} is set too; "
            "set one of them (eval_batches=null)"
        )
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
        problems.append(f"optimizer.lr={lr!r}: expected a number > 0")
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
    if not isinstance(spec.parallelism, DDPSpec) or spec.parallelism.shm_allreduce is not True:
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


def _check_pipeline(spec: RunSpec, problems: list[str]) -> None:
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


def _check_context(spec: RunSpec, problems: list[str]) -> None:
    """Context parallelism gives each rank the loss of its positions: a next-token loss."""
    context = spec.parallelism.context
    if context == 1:
        return
    if not spec.loss.target.endswith("CausalLM"):
        problems.append(
            f"parallelism.context={context}: loss._target_={spec.loss.target} cannot be split "
            "by position; context parallelism needs loss=causal_lm"
        )
    if spec.parallelism.pipeline > 1:
        problems.append(f"parallelism.context={context}: not with parallelism.pipeline yet")


def _check_expert(spec: RunSpec, problems: list[str]) -> None:
    """Expert groups are cut from the shard ranks (the model's experts are checked in the
    agent, which builds it)."""
    expert = spec.parallelism.expert
    if expert == 1:
        return
    grid = layout(spec)
    if grid.shard % expert:
        problems.append(
            f"parallelism.expert={expert}: must divide the shard ranks ({grid.shard} = world "
            f"{grid.world} / (pipeline x replicate x context x tensor)), which the expert "
            "groups are cut from"
        )
    if grid.context > 1:
        problems.append(f"parallelism.expert={expert}: not with parallelism.context yet")


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


def _check_trackers(spec: RunSpec, problems: list[str]) -> None:
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
        elif hardware.mfu_dtype(spec.precision.name.value) not in hardware.PEAK_TFLOPS[row]:
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


def _check_plan(spec: RunSpec, problems: list[str]) -> None:
    given = spec.plan.memory_per_rank
    if given is not None and bare_number(given):
        problems.append(
            f"plan.memory_per_rank={given}: a size needs its unit: {given}MB, {given}GB, or "
            f"{given}B for bytes"
        )
    elif given is not None and parse_size(given) is None:
        problems.append(
            f"plan.memory_per_rank={given}: not a size; give bytes with a unit, such as "
            "300MB, 2GB or 1.5GB (or null: a share of the device's memory)"
        )


def _check_resume(spec: RunSpec, problems: list[str], run_dir: Path | None) -> None:
    """Find the checkpoint this run starts from and check that it fits the spec."""
    from runner.rundir.checkpoints import CheckpointStore, resolve_checkpoint_path
    from runner.spec.resume_check import check_resume

    own = CheckpointStore(run_dir / "checkpoints", keep=1).latest() if run_dir else None
    if spec.eval_only:  # runner eval: a directory of its own, nothing to go on from
        _check_evaluation_only(spec, problems, run_dir)
        return
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


def _check_evaluation_only(spec: RunSpec, problems: list[str], run_dir: Path | None) -> None:
    """eval_only (`runner eval`) trains nothing: it has no checkpoint to go on from, and it
    never writes into a run's directory (an earlier run's files stay as they are)."""
    from runner.rundir.files import holds_a_run

    if spec.resume is not None:
        problems.append(
            f"resume={spec.resume}: runner eval trains nothing, so there is nothing to go on "
            "from; to evaluate a checkpoint give it as the source: runner eval CHECKPOINT"
        )
    if spec.profile.steps:
        problems.append(
            f"profile.steps={list(spec.profile.steps)}: runner eval takes no training step "
            "to trace; leave profile.steps out"
        )
    if run_dir is not None and holds_a_run(run_dir):
        problems.append(
            f"hydra.run.dir={run_dir}: holds a run already; runner eval writes into a "
            "directory of its own: leave hydra.run.dir out, or give a new one"
        )


LOGGER_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
