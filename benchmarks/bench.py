"""`make bench`: interleaved benchmarks of runner against a hand-written PyTorch script.

Each configuration runs `--reps` times; the order rotates every repetition so
slow drift of the machine hits every configuration alike. Reported per metric:
the median and the min-max, and for seconds per step the ratio of medians
against the plain PyTorch baseline (the first configuration of a suite).
Writes benchmarks/results/<suite>.md and prints it.

The harness (running commands, the tables) is harness.py; the suites are suites_speed.py,
suites_memory.py, suites_gpu.py and data_bench.py; this file names them and runs them.
"""

from __future__ import annotations

import argparse
import sys
import time

from data_bench import DATA_HOW, DATA_RATIO_METRICS, DATA_SUITES
from harness import RESULTS, Suite, run_suite
from suites_export import export_table
from suites_gpu import (
    auto_microbatch_suite,
    compile_suite,
    cuda_devices,
    gpu_gpt_suite,
    gpu_speed_suite,
    gpu_suite,
)
from suites_memory import (
    activation_notes,
    activation_suite,
    capacity_table,
    context_notes,
    context_suite,
    memory_gpt_suite,
    memory_suite,
    pipeline_notes,
    pipeline_suite,
    tensor_parallel_notes,
    tensor_parallel_suite,
)
from suites_moe import moe_notes, moe_recipe_table, moe_suite
from suites_plan import gpu_plan_table, plan_moe_table, plan_table
from suites_plan_families import families_table
from suites_speed import (
    CHECKPOINT_BLOCKED,
    CHECKPOINT_WRITTEN,
    LAUNCHER_LOG,
    LAUNCHER_STEPS,
    MFU,
    OVERHEAD_STEPS,
    PRUNED_STEPS,
    PRUNED_WALL,
    READY,
    SWEEP_JOBS,
    SWEEP_STEPS,
    SWEEP_WALL,
    TOKENS_PER_S,
    TRACKER_STEPS,
    checkpoint_async_suite,
    grad_norm_suite,
    launch_bound_suite,
    launchers_suite,
    mfu_cpu_suite,
    overhead_suite,
    pruning_suite,
    scaling_suite,
    sharded_step_suite,
    start_methods_suite,
    startup_suite,
    sweep_suite,
    sync_suite,
    trackers_suite,
)


def _overhead_how(model: str) -> str:
    short, long = OVERHEAD_STEPS[model]
    return (
        f"per-step time = (T({long} steps) - T({short} steps)) / their difference, each T "
        "timed from the end of the first step (the process's clock) to the end of the whole "
        "command (outside), one pair per repetition; time to first step from the short run"
    )


SUITES = {
    "overhead_resnet18": (
        "B1/B2 per-step overhead and time to first step: resnet18, synthetic 3x32x32, "
        "nproc=2, per-rank batches 8, 16 and 32, SGD lr 0.01 (no momentum, no schedule), "
        "fp32, timed from outside",
        overhead_suite("resnet18"),
        _overhead_how("resnet18"),
    ),
    "overhead_mlp": (
        "B1/B2 per-step overhead and time to first step: mlp, synthetic 3x32x32, "
        "nproc=2, per-rank batches 8, 16 and 32, SGD lr 0.01 (no momentum, no schedule), "
        "fp32, timed from outside",
        overhead_suite("mlp"),
        _overhead_how("mlp"),
    ),
    "checkpoint_async": (
        "Training blocked per checkpoint and time until it is sealed, checkpoint.async against "
        "sync and checkpoint.digest against none: a gpt of about 100 MB of state (2 layers, 512 "
        "wide, 64-token blocks, AdamW fp32), nproc=2, global batch 8, a checkpoint every 8 of "
        "40 steps",
        checkpoint_async_suite,
        "the medians over a run's checkpoints of the seconds its training waited "
        "(summary.json checkpoint_blocked_s) and of the seconds from a checkpoint's start until "
        "it was written, digested and sealed (checkpoint_written_s)",
        (CHECKPOINT_BLOCKED, CHECKPOINT_WRITTEN),
    ),
    "sharded_step": (
        "Per-step time of the sharded engines: runner's fsdp, zero2 and zero3 against a plain "
        "torchrun script of each (FSDP2 fully_shard per block; deepspeed.initialize, ZeRO "
        "stage 2 or 3), gpt (4 layers, 256 wide, 128-token blocks), nproc=2, global batch 16, "
        "AdamW, fp32",
        sharded_step_suite,
    ),
    "mfu_cpu": (
        "tokens/s and MFU on the CPU: the gpt_text recipe's gpt (4 layers, 128 wide, 128-token "
        "blocks, global batch 32), nproc=2 (a core each), fp32; the declared peak "
        "(mfu.peak_tflops) is one core's fp32 rate on a 2048 x 2048 matmul, measured first "
        "(the suite's log prints it); ratios against ddp",
        mfu_cpu_suite,
        "the medians of the run's own records after step 30 (throughput/tokens_per_sec, "
        "throughput/mfu)",
        (TOKENS_PER_S, MFU),
    ),
    "grad_norm": (
        "The cost of train/grad_norm without clipping: mlp, synthetic 3x32x32, nproc=2, "
        "batch 8/rank, SGD lr 0.01, fp32, timed from outside; ratios against "
        "log_grad_norm=false at the same log_interval",
        grad_norm_suite,
        _overhead_how("mlp"),
    ),
    "launchers": (
        "launcher=ray against launcher=elastic: resnet18, synthetic 3x32x32, nproc=2 and 1 "
        "(Ray: as many workers), a thread per rank, batch 16/rank, SGD lr 0.01, fp32; Ray's "
        "cluster is a local one each run starts and stops (its start is in the time to first "
        "step)",
        launchers_suite,
        f"one run of {LAUNCHER_STEPS} steps per configuration and repetition; s/step from the "
        f"run's own throughput records (one per {LAUNCHER_LOG} steps) after step "
        f"{2 * LAUNCHER_LOG}; time to first step from the command's start to summary.json's "
        "first_step_at",
    ),
    "trackers": (
        "B1 with trackers: mlp, synthetic 3x32x32, nproc=2, global batch 64, 2000 steps, a "
        "metrics record every 10 steps; s/step over the second half (trackers up); ratios "
        "against logger=none",
        trackers_suite,
        f"{TRACKER_STEPS} steps per run; s/step from the run's own throughput records of its "
        "second half, the walls from outside (command) and from summary.json (training)",
    ),
    "startup": (
        "B2 time to first step: forked ranks (default), spawned ranks, and the launcher not "
        "prestarted: mlp and resnet18, synthetic 3x32x32, nproc=2, global batch 64",
        startup_suite,
        "10 steps per run, timed from outside",
    ),
    "start_methods": (
        "How ranks start: runner's fork server against torch elastic's own start methods; 2 "
        "ranks that import torch, join a gloo group, build a DDP model and meet in one "
        "all-reduce, then end",
        start_methods_suite,
        "each run timed from the launcher's start (its own torch import included) to the last "
        "rank's all-reduce (ready) and to the last rank's end (wall)",
        (READY,),
    ),
    "sweep": (
        f"B2 in a sweep: {SWEEP_JOBS} mlp jobs of {SWEEP_STEPS} steps one after another "
        "(runner -m with seed=0..9; a shell loop of torchrun + the plain script), synthetic "
        "3x32x32, nproc=2, global batch 64; the wall time of the whole sweep",
        sweep_suite,
        "the sweep's wall time from outside",
        (SWEEP_WALL,),
    ),
    "pruning": (
        "The compute a pruner saves a search: hydra/sweeper=runner, 12 learning rates "
        "(log-uniform 1e-4..0.3, a seeded random sampler: the same 12 in every sweep), one "
        "trial at a time, mlp on digits, nproc=1, 1000 steps each, an evaluation every 100; "
        "ratios against the sweep without a pruner",
        pruning_suite,
        "per sweep: the steps its trials trained (each trial's summary.json), its wall time "
        "from outside, and its best completed trial (study.json) with its val/accuracy",
        (PRUNED_STEPS, PRUNED_WALL),
    ),
    "memory": (
        "B3 memory by parallelism: resnet18, synthetic 3x32x32, nproc=2, global batch 64, "
        "AdamW, fp32",
        memory_suite,
    ),
    "memory_gpt": (
        "B3 memory by parallelism: gpt (4 layers, 512 wide, 12.8M parameters), 64-token blocks, "
        "nproc=2, global batch 8, AdamW, fp32; ratios against runner ddp",
        memory_gpt_suite,
    ),
    "sync": (
        "B4 sync strategies: resnet18, synthetic 3x32x32, nproc=2, grad_accum=4, global batch 64",
        sync_suite,
    ),
    "scaling": (
        "B5 scaling: resnet18, synthetic 3x32x32, global batch 64, 1 thread per rank",
        scaling_suite,
    ),
    "compile": (
        "torch.compile on CPU: gpt (4 layers, 128 wide, 256-token blocks), nproc=2, global batch "
        "8, fp32, ddp; inductor's C++ kernels, a fresh compile cache every run; ratios against "
        "eager",
        compile_suite,
    ),
    "auto_microbatch": (
        "grad_accum=auto without an out-of-memory error: resnet18 (synthetic 3x32x32, global "
        "batch 64) under ddp and the compile suite's gpt under fsdp, nproc=2; ratios against "
        "grad_accum=1",
        auto_microbatch_suite,
    ),
    "gpu": (
        "GPU: resnet50 on synthetic 3x224x224 images (global batch 128, channels_last; ratio "
        "against torchrun + plain DDP, its batches cut from the in-memory images and pinned as "
        "runner's are) and gpt (12 layers, 768 wide, 1024-token blocks, global batch 16; ratios "
        "against nanoGPT's way: tokens on the device, fused AdamW, TF32), bf16, AdamW, one rank "
        "per GPU over nccl",
        gpu_suite,
    ),
    "gpu_gpt": (
        "GPU per-step parity: gpt (12 layers, 768 wide, 1024-token blocks) at global batch 16 "
        "and 32, eager and compiled, bf16; ratios against nanoGPT's way (plain_gpt.py: tokens on "
        "the device, fused AdamW, TF32), fsdp's against runner ddp on the same GPUs",
        gpu_gpt_suite,
    ),
    "gpu_speed": (
        "GPU past a plain script, both timed alike (20 warm-up steps left out, then at least "
        "100 timed): gpt 12x768 (1024-token blocks) at global batch 16 and 32, "
        "runner eager, compiled, compile.mode=reduce-overhead, fsdp and precision=float8 with "
        "compile; gpt 24x2048 at batch 8, compiled and float8; ratios against nanoGPT's way "
        "(plain_gpt.py) eager or compiled, fsdp against FSDP2 by hand (plain_gpt.py "
        "--engine=fsdp, bf16 parameters), float8 rows against compiled bf16; MFU against the "
        "GPU's bf16 peak. resnet50 at 224 px, channels_last, bf16, global batch 128, against "
        "a plain script in NVIDIA DeepLearningExamples' way (one synthetic batch on the device)",
        gpu_speed_suite,
    ),
}
SUITES: dict[str, Suite] = {name: Suite(*entry) for name, entry in SUITES.items()}
SUITES["launch_bound"] = Suite(
    "A step bound by launching ops on the CPU: gpt 12 layers x 32 wide, 64-token blocks, "
    "global batch 8, fp32, one rank; ratio against nanoGPT's way (plain_gpt.py --device=cpu)",
    launch_bound_suite,
    how="120 steps per run (at least), the first 20 not timed: the plain script by its own "
    "clock, runner by its records' time/step_s (a user's defaults: its tracker, its loader)",
)
SUITES["tensor_parallel"] = Suite(
    "B3 tensor parallelism: per-rank state of one gpt (4 layers, 512 wide) at TP2, FSDP4 and "
    "FSDP2 x TP2 against ddp's whole state (16 bytes a parameter), fp32, AdamW",
    tensor_parallel_suite,
    notes=tensor_parallel_notes,
)
SUITES["pipeline"] = Suite(
    "B3 pipeline parallelism: step time and state per rank of one gpt (4 layers, 512 wide, "
    "64-token blocks, global batch 8 in 4 microbatches, fp32, AdamW) at fixed work: one rank, "
    "and 2 pipeline stages on 2 ranks under each schedule",
    pipeline_suite,
    notes=pipeline_notes,
)
SUITES["context_parallel"] = Suite(
    "B3 context parallelism: peak activations per rank of one gpt training step (gpt_text's "
    "model, 2 sequences of 2048 tokens, fp32), the sequence split over 1, 2 and 4 ranks",
    context_suite,
    how="each rank's activations counted tensor by tensor (activation_probe.py --context)",
    notes=context_notes,
)
SUITES["moe"] = Suite(
    "B3 expert parallelism: step time and memory per rank of one gpt_moe (2 layers, 256 wide, "
    "8 experts, 2 per token, 64-token blocks, global batch 16, fp32, AdamW) on 4 ranks under "
    "fsdp at fixed work, the experts split over groups of 1, 2 and 4 ranks",
    moe_suite,
    notes=moe_notes,
)
SUITES["activation_checkpointing"] = Suite(
    "B3 activation checkpointing: gpt (4 layers, 128 wide), 1024-token blocks, nproc=2, "
    "global batch 16, fp32, AdamW; none, full (every block), every 2nd block, selective",
    activation_suite,
    notes=activation_notes,
)
SUITES |= {
    name: Suite(title, build, DATA_HOW.get(name), DATA_RATIO_METRICS)
    for name, (title, build) in DATA_SUITES.items()
}


# suites that write their own table (no interleaving)
TABLES = {
    "capacity": capacity_table,
    "export": export_table,
    "plan": plan_table,
    "plan_moe": plan_moe_table,
    "plan_families": families_table,
    "gpu_plan": gpu_plan_table,
    "moe_recipe": moe_recipe_table,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--suite", default="all", help=f"all, or some of {','.join([*SUITES, *TABLES])}"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="start no measurement after SECONDS; each table holds what was measured by then "
        "(the GPU check's limit)",
    )
    args = parser.parse_args()
    deadline = None if args.budget is None else time.monotonic() + args.budget
    RESULTS.mkdir(parents=True, exist_ok=True)
    every = [*SUITES, *TABLES]
    everything = [n for n in every if not n.startswith("gpu") or cuda_devices()]  # where one is
    names = everything if args.suite == "all" else args.suite.split(",")
    unknown = [name for name in names if name not in every]
    if unknown:
        parser.error(f"unknown suite {','.join(unknown)}; valid: {','.join(every)}")
    for name in names:
        print(f"benchmark suite {name} ...", file=sys.stderr, flush=True)
        if name in TABLES:
            table = TABLES[name](args.reps, args.steps, deadline)
        else:
            table = run_suite(SUITES[name], args.reps, args.steps, deadline)
        if not table:
            print(f"benchmark suite {name}: nothing measured within --budget", file=sys.stderr)
            continue
        (RESULTS / f"{name}.md").write_text(table)
        print(table, flush=True)
    # latest.md: the newest table of every suite, including those not rerun this time
    tables = [(RESULTS / f"{n}.md").read_text() for n in every if (RESULTS / f"{n}.md").exists()]
    (RESULTS / "latest.md").write_text("\n".join(tables))


if __name__ == "__main__":
    main()
