"""The checks between a spec's fields, and against this machine, that resolving runs once
every `auto` is resolved (runner.spec.resolve): each adds the problems it finds, naming the
key, the value and what would be valid, so that every one is reported at once, before any
rank starts. Here the run's own (its sizes, optimizer, run control, plan, resume); a
parallelism's in parallelism_checks, the machine's in environment_checks and
device_checks."""

from __future__ import annotations

import os
from pathlib import Path

from runner.spec.device_checks import check_compile, check_float8, check_profile
from runner.spec.environment_checks import check_cluster, check_mfu, check_trackers
from runner.spec.parallelism_checks import (
    check_async_checkpoints,
    check_auto_microbatching,
    check_context,
    check_deepspeed,
    check_pipeline,
    check_shm_allreduce,
    check_sync_strategy,
)
from runner.spec.plan_specs import bare_number, parse_size
from runner.spec.schema import RunSpec


def check_spec(spec: RunSpec, problems: list[str], run_dir: Path | None) -> None:
    """Every check, in this order (the order problems are listed in)."""
    _check_sizes(spec, problems)
    _check_optimizer(spec, problems)
    check_cluster(spec, problems)
    _check_run_control(spec, problems)
    check_sync_strategy(spec, problems)
    check_shm_allreduce(spec, problems)
    check_auto_microbatching(spec, problems)
    check_pipeline(spec, problems)
    check_context(spec, problems)
    check_compile(spec, problems)
    check_float8(spec, problems)
    check_profile(spec, problems)
    check_deepspeed(spec, problems)
    check_trackers(spec, problems)
    check_mfu(spec, problems)
    check_async_checkpoints(spec, problems)
    _check_plan(spec, problems)
    _check_resume(spec, problems, run_dir)


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
