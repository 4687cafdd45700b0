"""The checks of what runs on the device: torch.compile and its CUDA graphs, the
compiler's activation memory budget, float8 training. Each adds its problems to a list
(runner.spec.checks runs them in order)."""

from __future__ import annotations

import importlib.util
import os
import shutil

from runner import hardware
from runner.spec.parallelism_specs import DDPSpec
from runner.spec.schema import Precision, RunSpec


def check_compile(spec: RunSpec, problems: list[str]) -> None:
    options = spec.compile
    _check_memory_budget(spec, problems)
    if options is None:
        return
    bucket_mb = spec.parallelism.bucket_cap_mb if isinstance(spec.parallelism, DDPSpec) else 1
    if bucket_mb < 1:
        problems.append(
            f"parallelism.bucket_cap_mb={bucket_mb:g}: with compile, dynamo's DDP optimizer "
            "needs buckets of at least DDP's first one (1 MB); use bucket_cap_mb>=1, or "
            "compile=false"
        )
    _check_cuda_graphs(spec, problems)
    if spec.device == "cpu" and options.backend == "inductor":
        compiler = os.environ.get("CXX") or "g++"  # what inductor's CPU backend runs
        if shutil.which(compiler) is None:
            problems.append(
                f"compile.backend=inductor: on CPU it builds C++ kernels with {compiler}, "
                "which is not on PATH; install a C++ compiler (Debian/Ubuntu: apt-get install "
                f"g++; or set CXX), or use {options.typed(backend='aot_eager')}"
            )


def _check_cuda_graphs(spec: RunSpec, problems: list[str]) -> None:
    """CUDA graphs replay a step's kernels recorded once, for one shape, with no host in
    between: what breaks that is refused."""
    assert spec.compile is not None
    if not spec.compile.captures_graphs:
        return
    key = f"compile.mode={spec.compile.mode}"
    instead = spec.compile.typed(mode="default")  # as typed, it works
    if spec.device != "cuda":
        problems.append(
            f"{key}: captures CUDA graphs, which need device=cuda (device={spec.device}); "
            f"use {instead}"
        )
    if spec.grad_accum == "auto":
        problems.append(
            f"{key}: grad_accum=auto recuts microbatches to new sizes when memory runs out, "
            "and every size would record graphs of its own in a pool kept apart; set grad_accum"
        )
    if spec.parallelism.name != "ddp":
        problems.append(
            f"{key}: not under parallelism={spec.parallelism.name} (its gathers and reductions "
            f"run from hooks on the host between the graph's kernels); use parallelism=ddp, or "
            f"{instead}"
        )
    if spec.data.args.get("min_length") is not None:
        problems.append(
            f"{key}: data.min_length={spec.data.args['min_length']} makes batches of many "
            "lengths, and every shape records graphs of its own; use data.min_length=null"
        )
    if spec.nonfinite == "skip":
        problems.append(
            f"{key}: nonfinite=skip reads every step's verdict on the host, which then waits "
            "for the device each step (what CUDA graphs save); use nonfinite=stop"
        )


def _check_memory_budget(spec: RunSpec, problems: list[str]) -> None:
    budget = spec.activation_memory_budget
    if budget is None:
        return
    key = f"activation_memory_budget={budget:g}"
    if spec.compile is None or spec.compile.backend == "eager":
        problems.append(
            f"{key}: the compiler's partitioner (AOTAutograd's, under compile with the inductor "
            "or aot_eager backend) chooses what to recompute within the budget, and without it "
            "nothing does; set compile=true, or use activation_checkpointing=selective"
        )
    if spec.activation_checkpointing != "none":
        problems.append(
            f"{key} with activation_checkpointing={spec.activation_checkpointing}: choose one "
            "(the budget lets the compiler decide what every block recomputes)"
        )


def check_float8(spec: RunSpec, problems: list[str]) -> None:
    """precision=float8: torchao installed, an engine that keeps the model's layers (ddp,
    fsdp), a GPU with float8 matmuls (runner.engines.float8)."""
    if spec.precision.name is not Precision.FLOAT8:
        return
    if importlib.util.find_spec("torchao") is None:
        problems.append(
            f"precision=float8: needs torchao, which is not installed; {hardware.FLOAT8_INSTALL}"
        )
    if spec.parallelism.name.startswith("zero"):
        problems.append(
            f"precision=float8: not under parallelism={spec.parallelism.name} (DeepSpeed "
            "casts the model itself); use parallelism=ddp or fsdp"
        )
    if spec.device == "cuda":
        problem = hardware.float8_problem(hardware.cuda_compute_capabilities())
        if problem:
            problems.append(problem)


def check_profile(spec: RunSpec, problems: list[str]) -> None:
    """profile.*: steps the run takes, ranks it has, memory snapshots where there is CUDA."""
    options = spec.profile
    bad = [s for s in options.steps if s < 1 or (spec.max_steps and s > spec.max_steps)]
    if bad:
        last = f" (max_steps={spec.max_steps})" if spec.max_steps else ""
        problems.append(
            f"profile.steps={list(options.steps)}: {bad} not a step this run takes; valid: "
            f"optimizer steps from 1{last}"
        )
    if isinstance(options.ranks, tuple):
        outside = [r for r in options.ranks if not 0 <= r < spec.world_size]
        if not options.ranks:
            problems.append(
                f"profile.ranks=[]: no rank to trace on; valid: main, all, or ranks in "
                f"0..{spec.world_size - 1}"
            )
        if outside:
            problems.append(
                f"profile.ranks={list(options.ranks)}: {outside} not a rank of this run; "
                f"valid: main, all, or ranks in 0..{spec.world_size - 1}"
            )
    if options.memory and spec.device != "cuda":
        problems.append(
            f"profile.memory=true: CUDA memory snapshots need device=cuda (device="
            f"{spec.device}); on a CPU the traces (profile.steps) show each op's memory"
        )
