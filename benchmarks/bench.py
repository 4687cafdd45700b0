"""`make bench`: interleaved benchmarks of runner against a hand-written PyTorch script.

Each configuration runs `--reps` times; the order rotates every repetition so
slow drift of the machine hits every configuration alike. Reported per metric:
the median and the min-max, and for seconds per step the ratio of medians
against the plain PyTorch baseline (the first configuration of a suite).
Writes benchmarks/results/<suite>.md and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from common import (
    FIRST,
    MB,
    REPO,
    RESULTS,
    SPS,
    STATE,
    STEP,
    WARMUP,
    Config,
    run,
    thread_env,
    time_command,
    venv_tool,
)
from data_bench import DATA_HOW, DATA_RATIO_METRICS, DATA_SUITES


def run_runner(
    *overrides: str, nproc: int, steps: int, threads: int | None = None
) -> dict[str, float]:
    """One runner run: seconds per step from its metrics (steps after WARMUP, evaluation
    excluded), and the largest rank's optimizer state and peak RSS from its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [venv_tool("runner"), *overrides, f"nproc={nproc}", "max_epochs=null"]
        command += [f"max_steps={steps}", f"log_interval={WARMUP}", "progress_bar=false"]
        command += [f"hydra.run.dir={run_dir}"]
        env = thread_env(nproc, threads)
        run(command, env, cwd=tmp)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        batch = yaml.safe_load((run_dir / "config.yaml").read_text())["global_batch_size"]
        summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in lines]
    intervals = [batch / r["throughput/samples_per_sec"] for r in records if r["step"] > WARMUP]
    return {
        STEP: statistics.fmean(intervals),
        SPS: batch / statistics.fmean(intervals),
        STATE: max(rank["total"] for rank in summary["state_bytes"]) / MB,
        "optimizer state MB/rank": max(summary["optimizer_state_bytes"]) / MB,
        "peak RSS MB/rank": max(summary["peak_rss_bytes"]) / MB,
    }


def plain_command(*args: str, nproc: int, steps: int, warmup: int = WARMUP) -> list[str]:
    command = [venv_tool("torchrun"), "--standalone", f"--nproc-per-node={nproc}"]
    command += [str(REPO / "benchmarks" / "plain_ddp.py"), f"--steps={steps}"]
    return [*command, f"--warmup={warmup}", *args]


def run_plain(*args: str, nproc: int, steps: int, threads: int | None = None) -> dict[str, float]:
    stdout = run(plain_command(*args, nproc=nproc, steps=steps), thread_env(nproc, threads))
    result = json.loads(stdout.strip().splitlines()[-1])
    batch = int(next(a.split("=")[1] for a in args if a.startswith("--global-batch-size")))
    return {
        STEP: result["sec_per_step"],
        SPS: batch / result["sec_per_step"],
        STATE: result["state_bytes"] / MB,
        "optimizer state MB/rank": result["optimizer_state_bytes"] / MB,
        "peak RSS MB/rank": result["peak_rss_bytes"] / MB,
    }


# --- B1 + B2: per-step overhead and time to first step, timed from outside -------------


def outside_runner(
    model: str,
    steps: int,
    nproc: int = 2,
    prestart: bool = True,
    extra: tuple[str, ...] = (),
    batch: int = 64,
) -> tuple[float, float]:
    """(wall seconds, seconds from the command's start to the first optimizer step done).

    Without `prestart` the run goes through `python -m runner.cli.main`, which starts the
    launcher only after Hydra is done (the console script `runner` starts it first).
    """
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [venv_tool("runner")] if prestart else [sys.executable, "-m", "runner.cli.main"]
        command += [f"model={model}", "data=synthetic", f"nproc={nproc}"]
        command += [f"global_batch_size={batch}", f"max_steps={steps}", "max_epochs=null"]
        command += ["eval_interval=1000000", f"hydra.run.dir={run_dir}"]  # eval: last step only
        wall, start, _ = time_command([*command, *extra], tmp, nproc)
        first = json.loads((run_dir / "summary.json").read_text())["first_step_at"]
    return wall, first - start


def outside_plain(
    model: str, steps: int, nproc: int = 2, batch: int = 64, extra: tuple[str, ...] = ()
) -> tuple[float, float]:
    args = (f"--model={model}", f"--global-batch-size={batch}", *extra)
    with tempfile.TemporaryDirectory() as tmp:
        command = plain_command(*args, nproc=nproc, steps=steps, warmup=0)
        wall, start, stdout = time_command(command, tmp, nproc)
    first = json.loads(stdout.strip().splitlines()[-1])["first_step_at"]
    return wall, first - start


# steps (short, long) per model: the difference must dwarf the run-to-run noise of
# startup (about +-0.3 s here), so the mlp's ~5 ms steps need many more than resnet18's.
OVERHEAD_STEPS = {"resnet18": (20, 120), "mlp": (200, 2000)}
OVERHEAD_BATCHES = (8, 16, 32)  # per rank (2 ranks): where runner's fixed cost per step shows
# Both sides: SGD at lr 0.01 without momentum or schedule, fp32, 1 thread per rank.
SGD_RUNNER = ("optimizer=sgd", "optimizer.lr=0.01", "optimizer.momentum=0.0", "scheduler=constant")
SGD_PLAIN = ("--optimizer=sgd", "--lr=0.01")


def overhead_config(name: str, measure, model: str, baseline: str | None = None) -> Config:
    short, long = OVERHEAD_STEPS[model]

    def both() -> dict[str, float]:
        # Timed from the first step's end to the command's end: start-up's noise (+-0.3 s
        # here) stays out, and what a run does after its last step cancels in the difference.
        wall_short, first = measure(model, short)
        wall_long, first_long = measure(model, long)
        per_step = ((wall_long - first_long) - (wall_short - first)) / (long - short)
        return {STEP: per_step, FIRST: first}

    return Config(name, both, baseline)


def overhead_suite(model: str) -> Callable[[int], list[Config]]:
    """For each per-rank batch: torchrun + the plain script, and runner with its defaults
    (the hang watchdog and the non-finite guard on), compared pairwise."""

    def build(_steps: int) -> list[Config]:
        configs = []
        for per_rank in OVERHEAD_BATCHES:
            plain = f"torchrun + plain PyTorch DDP, batch {per_rank}/rank"
            batch = 2 * per_rank
            configs += [
                overhead_config(
                    plain, partial(outside_plain, batch=batch, extra=SGD_PLAIN), model, plain
                ),
                overhead_config(
                    f"runner, batch {per_rank}/rank",
                    partial(outside_runner, batch=batch, extra=SGD_RUNNER),
                    model,
                    baseline=plain,
                ),
            ]
        return configs

    return build


TRACKER_STEPS = 2000
TRACKER_WALL, TRACKER_TRAIN = "command wall s", "training wall s"


def tracker_row(logger: str) -> Config:
    """One runner run with `logger`: seconds per step once the trackers are up (the second
    half of the run, from its own throughput records), and the wall time of the command and
    of the training (summary.json), which hold the trackers' one-off costs (imports, opening
    a store, ending a run). MLflow's store is a fresh SQLite file in the run's temporary
    directory every time (its tables are created each run: the worst case)."""

    def measure() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            command = [venv_tool("runner"), "model=mlp", "data=synthetic", "nproc=2"]
            command += ["global_batch_size=64", f"max_steps={TRACKER_STEPS}", "max_epochs=null"]
            command += ["eval_interval=1000000", "progress_bar=false", f"logger={logger}"]
            wall, _, _ = time_command([*command, f"hydra.run.dir={run_dir}"], tmp, 2)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            summary = json.loads((run_dir / "summary.json").read_text())
        later = [
            64 / r["throughput/samples_per_sec"]
            for r in records
            if r["step"] > TRACKER_STEPS // 2 and "throughput/samples_per_sec" in r
        ]
        return {
            STEP: statistics.fmean(later),
            TRACKER_TRAIN: summary["wall_time_s"],
            TRACKER_WALL: wall,
        }

    return Config(f"runner logger={logger}", measure)


def trackers_suite(_steps: int) -> list[Config]:
    loggers = ("none", "tensorboard", "csv", "mlflow", "wandb", "[tensorboard,csv,mlflow,wandb]")
    return [tracker_row(logger) for logger in loggers]


def startup_suite(_steps: int) -> list[Config]:
    """B2 alone, for both models: forked ranks (the default), spawned ranks (every rank
    imports torch itself, as before the fork server), and the launcher not prestarted."""

    def first_step(model: str, measure: Callable[..., tuple[float, float]], **kwargs: Any):
        return lambda: {FIRST: measure(model, 10, **kwargs)[1]}

    configs = []
    for model in ("mlp", "resnet18"):
        plain = f"torchrun + plain PyTorch DDP, {model}"
        spawn = ("start_method=spawn",)
        configs += [
            Config(plain, first_step(model, outside_plain), plain),
            Config(f"runner, {model}", first_step(model, outside_runner), plain),
            Config(
                f"runner start_method=spawn, {model}",
                first_step(model, outside_runner, extra=spawn),
                plain,
            ),
            Config(
                f"runner, launcher not prestarted, {model}",
                first_step(model, outside_runner, prestart=False),
                plain,
            ),
        ]
    return configs


SWEEP_JOBS, SWEEP_STEPS = 10, 20
SWEEP_WALL = "sweep wall s"


def sweep_suite(_steps: int) -> list[Config]:
    """A sweep of many short jobs, where start-up is most of the time: SWEEP_JOBS mlp runs of
    SWEEP_STEPS steps, one after another, as `runner -m` and as a shell loop of torchrun."""
    job = ["model=mlp", "data=synthetic", "nproc=2", "global_batch_size=64", "max_epochs=null"]
    job += [f"max_steps={SWEEP_STEPS}", "eval_interval=1000000", "progress_bar=false"]
    seeds = "seed=" + ",".join(str(i) for i in range(SWEEP_JOBS))

    def runner_sweep(*extra: str) -> Callable[[], dict[str, float]]:
        def measure() -> dict[str, float]:
            with tempfile.TemporaryDirectory() as tmp:
                command = [venv_tool("runner"), "-m", *job, seeds, *extra]
                wall, _, _ = time_command([*command, f"hydra.sweep.dir={tmp}/sweep"], tmp, 2)
            return {SWEEP_WALL: wall}

        return measure

    def plain_loop() -> dict[str, float]:
        args = ("--model=mlp", "--global-batch-size=64")
        start = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(SWEEP_JOBS):
                time_command(plain_command(*args, nproc=2, steps=SWEEP_STEPS, warmup=0), tmp, 2)
        return {SWEEP_WALL: time.time() - start}

    plain = f"{SWEEP_JOBS} x torchrun + plain PyTorch DDP"
    return [
        Config(plain, plain_loop),
        Config("runner -m, start_method=spawn", runner_sweep("start_method=spawn"), plain),
        Config("runner -m", runner_sweep(), plain),
    ]


# --- B3 memory, B4 sync strategies, B5 scaling ------------------------------------------

RESNET = ["model=resnet18", "data=synthetic", "global_batch_size=64"]


def plain_resnet(grad_accum: int, steps: int, nproc: int = 2, threads: int | None = None) -> Config:
    args = ("--model=resnet18", f"--grad-accum={grad_accum}", "--global-batch-size=64")
    label = "plain PyTorch DDP" + (" (no_sync)" if grad_accum > 1 else "")
    return Config(label, lambda: run_plain(*args, nproc=nproc, steps=steps, threads=threads))


def runner_row(name: str, overrides: tuple[str, ...], steps: int) -> Config:
    return Config(name, lambda: run_runner(*overrides, nproc=2, steps=steps))


def sync_suite(steps: int) -> list[Config]:
    rows = [
        runner_row(
            f"runner sync_strategy={s}", (*RESNET, "grad_accum=4", f"sync_strategy={s}"), steps
        )
        for s in ("single_auto_sync", "multi_auto_sync", "forced_sync")
    ]
    return [plain_resnet(4, steps), *rows]


def memory_suite(steps: int) -> list[Config]:
    rows = [
        runner_row(f"runner parallelism={p}", (*RESNET, f"parallelism={p}"), steps)
        for p in ("ddp", "zero1", "zero2", "zero3", "fsdp")
    ]
    return [plain_resnet(1, steps), *rows]


# The gpt for the memory goal: every weight matrix over DeepSpeed's parameter-persistence
# threshold (1e5 elements), so zero3 partitions them at its defaults.
GPT_WIDE = [
    "+recipe=gpt_text",
    "model.n_embd=512",
    "model.n_head=8",
    "data.block_size=64",
    "global_batch_size=8",
    "eval_interval=null",
    "grad_clip_norm=null",
]


def memory_gpt_suite(steps: int) -> list[Config]:
    """Per-rank state by parallelism on the gpt, activation checkpointing off and on;
    the baseline is runner's ddp (the goal is a fraction of DDP's state)."""
    configs = [
        runner_row(f"runner gpt parallelism={p}", (*GPT_WIDE, f"parallelism={p}"), steps)
        for p in ("ddp", "zero1", "zero2", "zero3", "fsdp")
    ]
    configs += [
        runner_row(
            f"runner gpt parallelism={p} activation_checkpointing=full",
            (*GPT_WIDE, f"parallelism={p}", "activation_checkpointing=full"),
            steps,
        )
        for p in ("ddp", "zero3", "fsdp")
    ]
    return configs


# A sequence length where activations dominate: 1024 tokens, 8 sequences per rank.
GPT_LONG = [
    "+recipe=gpt_text",
    "data.block_size=1024",
    "global_batch_size=16",
    "eval_interval=null",
]


def activation_suite(steps: int) -> list[Config]:
    """Activation checkpointing on the gpt model: peak memory (RSS) against step time."""
    return [
        runner_row(
            f"runner gpt activation_checkpointing={m}",
            (*GPT_LONG, f"activation_checkpointing={m}"),
            steps,
        )
        for m in ("none", "full", "2")
    ]


BUDGET_MB = 256  # per rank: parameters + gradients + optimizer state
CAPACITY_LAYERS = (2, 4, 6, 8, 10, 12, 14)


def gpt_parameters(n_layer: int, width: int = 512, vocab: int = 256, block: int = 64) -> int:
    """The GPT_WIDE model's parameter count (runner/models/gpt.py, no biases, untied head)."""
    per_layer = 12 * width * width + 2 * width
    return n_layer * per_layer + 2 * vocab * width + block * width + width


def measure_state(*overrides: str) -> dict[str, float]:
    """A short 2-rank run (3 steps): the largest rank's state and peak RSS, in MB."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [venv_tool("runner"), *overrides, "nproc=2", "max_steps=3", "log_interval=1"]
        command += ["progress_bar=false", f"hydra.run.dir={run_dir}"]
        run(command, thread_env(2), cwd=tmp)
        summary = json.loads((run_dir / "summary.json").read_text())
    return {
        STATE: max(rank["total"] for rank in summary["state_bytes"]) / MB,
        "peak RSS MB/rank": max(summary["peak_rss_bytes"]) / MB,
    }


def capacity_table(_reps: int, _steps: int) -> str:
    """The deepest GPT_WIDE that trains at nproc=2 within BUDGET_MB of state per rank: each
    parallelism climbs CAPACITY_LAYERS until a run's measured state exceeds the budget."""
    lines = [
        f"### B3 capacity: the largest gpt (512 wide, 64-token blocks) that trains at nproc=2 "
        f"within {BUDGET_MB} MB of state (parameters + gradients + optimizer state) per rank, "
        "AdamW, fp32",
        "",
        f"Machine: {machine()}. One 3-step run per depth ({', '.join(map(str, CAPACITY_LAYERS))}"
        " layers), climbing until the measured state (summary.json state_bytes, largest rank) "
        "exceeds the budget.",
        "",
        "| parallelism | layers | parameters (M) | state MB/rank | peak RSS MB/rank | "
        "next depth's state MB/rank |",
        "|---|---|---|---|---|---|",
    ]
    for parallelism in ("ddp", "zero2", "zero3", "fsdp"):
        fits, over = None, None
        for n_layer in CAPACITY_LAYERS:
            result = measure_state(
                *GPT_WIDE, f"parallelism={parallelism}", f"model.n_layer={n_layer}"
            )
            print(f"  {parallelism} n_layer={n_layer}: {result}", file=sys.stderr, flush=True)
            if result[STATE] > BUDGET_MB:
                over = result
                break
            fits = (n_layer, result)
        if fits is None:
            lines.append(f"| {parallelism} | none | | | | {over[STATE]:.1f} |")
            continue
        n_layer, result = fits
        beyond = f"{over[STATE]:.1f}" if over else "(ladder ends)"
        lines.append(
            f"| {parallelism} | {n_layer} | {gpt_parameters(n_layer) / 1e6:.1f} | "
            f"{result[STATE]:.1f} | {result['peak RSS MB/rank']:.0f} | {beyond} |"
        )
    return "\n".join(lines) + "\n"


def scaling_suite(steps: int) -> list[Config]:
    """Samples/s at nproc 1 and 2 with one thread per rank: the second core's worth."""
    configs = []
    for nproc in (1, 2):
        measure = plain_resnet(1, steps, nproc, threads=1).measure
        plain = Config(f"plain PyTorch DDP nproc={nproc}", measure)
        configs.append(plain)
        configs.append(
            Config(
                f"runner nproc={nproc}",
                lambda n=nproc: run_runner(*RESNET, nproc=n, steps=steps, threads=1),
                baseline=plain.name,
            )
        )
    return configs


# --- GPU: runner against torchrun + plain DDP on the same GPU(s) ------------------------

GPU_BATCH = {"resnet50": 128, "gpt": 16}  # global batch: images, or 1024-token sequences
GPT_SHAPE = {"block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}
ITEMS = "images or tokens/s"


GPU_NAME: list[str] = []  # filled by the gpu suite, for the table's machine line


def cuda_devices() -> int:
    import torch

    if torch.cuda.is_available() and not GPU_NAME:
        GPU_NAME.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    return torch.cuda.device_count()


def gpu_rows(model: str, steps: int, corpus: Path) -> list[Config]:
    """Plain DDP and runner training `model` in bf16 on every visible GPU (nccl)."""
    gpus, batch = cuda_devices(), GPU_BATCH[model]
    per_item = GPT_SHAPE["block_size"] if model == "gpt" else 1  # tokens per sample
    if model == "gpt":
        plain_args = [f"--{k.replace('_', '-')}={v}" for k, v in GPT_SHAPE.items()]
        runner_args = ["model=gpt", "data=text", f"data.root={corpus}", "loss=causal_lm"]
        runner_args += ["metrics=language_model", f"data.block_size={GPT_SHAPE['block_size']}"]
        runner_args += [f"model.{k}={v}" for k, v in GPT_SHAPE.items() if k != "block_size"]
    else:
        plain_args = ["--image-size=224", "--channels-last"]
        runner_args = ["model=resnet50", "data=synthetic", "data.image_size=224"]
        runner_args += ["model.channels_last=true"]
    plain_args += [f"--model={model}", "--device=cuda", "--precision=bf16"]
    plain_args += [f"--global-batch-size={batch}"]
    runner_args += ["device=cuda", "precision=bf16", f"global_batch_size={batch}"]
    runner_args += ["eval_interval=1000000", "checkpoint.interval=null"]

    def with_items(result: dict[str, float]) -> dict[str, float]:
        return {STEP: result[STEP], ITEMS: result[SPS] * per_item, STATE: result[STATE]}

    plain = Config(
        f"torchrun + plain PyTorch DDP, {model}",
        lambda: with_items(run_plain(*plain_args, nproc=gpus, steps=steps)),
    )
    ours = Config(
        f"runner, {model}",
        lambda: with_items(run_runner(*runner_args, nproc=gpus, steps=steps)),
        baseline=plain.name,
    )
    return [plain, ours]


def random_corpus(characters: int) -> Path:
    """A directory with one text file of random letters (byte tokens for runner's gpt)."""
    import random

    corpus = Path(tempfile.mkdtemp(prefix="runner-bench-corpus-"))
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz      \n"
    (corpus / "random.txt").write_text("".join(rng.choice(letters) for _ in range(characters)))
    return corpus


def gpu_suite(steps: int) -> list[Config]:
    if cuda_devices() == 0:
        sys.exit("the gpu suite needs a CUDA device; none is visible")
    corpus = random_corpus(2_500_000)
    return [*gpu_rows("resnet50", steps, corpus), *gpu_rows("gpt", steps, corpus)]


# --- compile: time to first step and step time, eager against torch.compile --------------

COMPILE_S = "compile s"
COMPILE_GPT = ["model=gpt", "model.n_layer=4", "model.n_embd=128", "data=text"]
COMPILE_GPT += ["data.block_size=256", "loss=causal_lm", "metrics=language_model"]
COMPILE_GPT += ["global_batch_size=8", "eval_interval=1000000"]


def compile_row(name: str, extra: tuple[str, ...], steps: int, corpus: Path) -> Config:
    """One run: s/step after the warmup (own clocks), seconds from the command's start to
    the first step done, and summary.json's compile_s. A fresh inductor cache each run
    (TORCHINDUCTOR_CACHE_DIR), so the compile is paid in full as on a first run."""

    def measure() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            command = [venv_tool("runner"), *COMPILE_GPT, f"data.root={corpus}", "nproc=2"]
            command += [f"max_steps={steps}", "max_epochs=null", f"log_interval={WARMUP}"]
            command += ["progress_bar=false", *extra, f"hydra.run.dir={run_dir}"]
            env = {**thread_env(2), "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
            start = time.time()
            run(command, env, cwd=tmp)
            summary = json.loads((run_dir / "summary.json").read_text())
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        later = [8 / r["throughput/samples_per_sec"] for r in records if r["step"] > WARMUP]
        return {
            STEP: statistics.fmean(later),
            FIRST: summary["first_step_at"] - start,
            COMPILE_S: summary["compile_s"] or 0.0,
        }

    return Config(name, measure)


def compile_suite(steps: int) -> list[Config]:
    corpus = random_corpus(200_000)
    return [
        compile_row("runner, eager", (), steps, corpus),
        compile_row("runner compile=true (per block)", ("compile=true",), steps, corpus),
        compile_row(
            "runner compile={per_block:false} (whole model)",
            ("compile={per_block:false}",),
            steps,
            corpus,
        ),
    ]


def auto_microbatch_suite(steps: int) -> list[Config]:
    """What grad_accum=auto costs when nothing runs out of memory: one small all-reduce per
    microbatch (and, under fsdp, one before each block's forward), each read on the host."""
    corpus = random_corpus(200_000)
    gpt = [*COMPILE_GPT, f"data.root={corpus}", "parallelism=fsdp"]
    return [
        runner_row("runner ddp resnet18, grad_accum=1", (*RESNET,), steps),
        runner_row("runner ddp resnet18, grad_accum=auto", (*RESNET, "grad_accum=auto"), steps),
        Config(
            "runner fsdp gpt, grad_accum=1",
            lambda: run_runner(*gpt, nproc=2, steps=steps),
            baseline="runner fsdp gpt, grad_accum=1",
        ),
        Config(
            "runner fsdp gpt, grad_accum=auto",
            lambda: run_runner(*gpt, "grad_accum=auto", nproc=2, steps=steps),
            baseline="runner fsdp gpt, grad_accum=1",
        ),
    ]


SUITES = {
    "overhead_resnet18": (
        "B1/B2 per-step overhead and time to first step: resnet18, synthetic 3x32x32, "
        "nproc=2, per-rank batches 8, 16 and 32, SGD lr 0.01 (no momentum, no schedule), "
        "fp32, timed from outside",
        overhead_suite("resnet18"),
    ),
    "overhead_mlp": (
        "B1/B2 per-step overhead and time to first step: mlp, synthetic 3x32x32, "
        "nproc=2, per-rank batches 8, 16 and 32, SGD lr 0.01 (no momentum, no schedule), "
        "fp32, timed from outside",
        overhead_suite("mlp"),
    ),
    "trackers": (
        "B1 with trackers: mlp, synthetic 3x32x32, nproc=2, global batch 64, 2000 steps, a "
        "metrics record every 10 steps; s/step over the second half (trackers up); ratios "
        "against logger=none",
        trackers_suite,
    ),
    "startup": (
        "B2 time to first step: forked ranks (default), spawned ranks, and the launcher not "
        "prestarted: mlp and resnet18, synthetic 3x32x32, nproc=2, global batch 64",
        startup_suite,
    ),
    "sweep": (
        f"B2 in a sweep: {SWEEP_JOBS} mlp jobs of {SWEEP_STEPS} steps one after another "
        "(runner -m with seed=0..9; a shell loop of torchrun + the plain script), synthetic "
        "3x32x32, nproc=2, global batch 64; the wall time of the whole sweep",
        sweep_suite,
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
        "GPU: resnet50 on synthetic 3x224x224 images (global batch 128, channels_last) and gpt "
        "(12 layers, 768 wide, 1024-token blocks, global batch 16), bf16, AdamW, one rank "
        "per GPU over nccl; ratios against torchrun + plain DDP on the same model",
        gpu_suite,
    ),
    "activation_checkpointing": (
        "B3 activation checkpointing: gpt (4 layers, 128 wide), 1024-token blocks, nproc=2, "
        "global batch 16, fp32, AdamW",
        activation_suite,
    ),
    **DATA_SUITES,
}


def machine() -> str:
    gpus = f"{GPU_NAME[0]}, " if GPU_NAME else ""
    return (
        f"{gpus}{os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"torch {metadata.version('torch')}, deepspeed {metadata.version('deepspeed')}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
    )


# compared with the baseline; the rest shown as is
RATIO_METRICS = (STEP, FIRST, SPS, STATE, ITEMS, SWEEP_WALL, *DATA_RATIO_METRICS)


def _cell(values: list[float], digits: int) -> str:
    median, low, high = statistics.median(values), min(values), max(values)
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def run_suite(name: str, reps: int, steps: int) -> str:
    title, build = SUITES[name]
    configs = build(steps)
    results: dict[str, list[dict[str, float]]] = {c.name: [] for c in configs}
    for rep in range(reps):
        shift = rep % len(configs)
        for config in configs[shift:] + configs[:shift]:
            results[config.name].append(config.measure())
            print(
                f"  rep {rep + 1}/{reps} {config.name}: {results[config.name][-1]}",
                file=sys.stderr,
                flush=True,
            )
    metrics = list(results[configs[0].name][0])
    header = ["configuration"]
    for metric in metrics:
        header.append(f"{metric} median (min-max)" if metric in RATIO_METRICS else metric)
        if metric in RATIO_METRICS:
            header.append("ratio")
    how = (
        f"per-step time = (T({OVERHEAD_STEPS[name.split('_')[1]][1]} steps) - "
        f"T({OVERHEAD_STEPS[name.split('_')[1]][0]} steps)) / their difference, each T "
        "timed from the end of the first step (the process's clock) to the end of the whole "
        "command (outside), one pair per repetition; time to first step from the short run"
        if name.startswith("overhead")
        else "10 steps per run, timed from outside"
        if name == "startup"
        else "the sweep's wall time from outside"
        if name == "sweep"
        else f"{TRACKER_STEPS} steps per run; s/step from the run's own throughput records "
        "of its second half, the walls from outside (command) and from summary.json (training)"
        if name == "trackers"
        else DATA_HOW.get(
            name, f"{steps} steps per run, the first {WARMUP} not timed (the processes' own clocks)"
        )
    )
    lines = [
        f"### {title}",
        "",
        f"Machine: {machine()}. {reps} interleaved repetitions; {how}. Ratios: median against "
        "the median of the baseline it is paired with (plain PyTorch unless the title says "
        "otherwise). Memory: the largest rank.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for config in configs:
        baseline = results[config.baseline or configs[0].name]
        cells = [config.name]
        for metric in metrics:
            values = [r[metric] for r in results[config.name]]
            if metric in RATIO_METRICS:
                reference = statistics.median(r[metric] for r in baseline)
                small = metric == STEP and statistics.median(values) < 0.05  # ms-scale steps
                cells += [
                    _cell(values, 1 if metric in (SPS, STATE, ITEMS) else 5 if small else 3),
                    f"{statistics.median(values) / reference:.3f}",
                ]
            else:
                cells.append(f"{statistics.median(values):.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


TABLES = {"capacity": capacity_table}  # suites that write their own table (no interleaving)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--suite", default="all", help=f"all, or some of {','.join([*SUITES, *TABLES])}"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    every = [*SUITES, *TABLES]
    everything = [n for n in every if n != "gpu" or cuda_devices()]  # gpu: where there is one
    names = everything if args.suite == "all" else args.suite.split(",")
    unknown = [name for name in names if name not in every]
    if unknown:
        parser.error(f"unknown suite {','.join(unknown)}; valid: {','.join(every)}")
    for name in names:
        print(f"benchmark suite {name} ...", file=sys.stderr, flush=True)
        if name in TABLES:
            table = TABLES[name](args.reps, args.steps)
        else:
            table = run_suite(name, args.reps, args.steps)
        (RESULTS / f"{name}.md").write_text(table)
        print(table, flush=True)
    # latest.md: the newest table of every suite, including those not rerun this time
    tables = [(RESULTS / f"{n}.md").read_text() for n in every if (RESULTS / f"{n}.md").exists()]
    (RESULTS / "latest.md").write_text("\n".join(tables))


if __name__ == "__main__":
    main()
